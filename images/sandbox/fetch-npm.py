"""Install node and npm from the npm registry inside an image build, checking npm's sha512 integrity.

Usage: fetch-npm.py NAME@VERSION#INTEGRITY NAME@VERSION#INTEGRITY   (node first, then npm)

Standard library only: the base image has python3 but no node yet.
"""

import base64
import hashlib
import io
import os
import sys
import tarfile
import time
import urllib.request

REGISTRY = os.environ.get("NPM_CONFIG_REGISTRY", "https://registry.npmjs.org").rstrip("/")
PREFIX = "/usr/local"


def fetch(spec: str) -> tarfile.TarFile:
    name_version, _, integrity = spec.partition("#")
    name, _, version = name_version.rpartition("@")
    url = f"{REGISTRY}/{name}/-/{name.rsplit('/', 1)[-1]}-{version}.tgz"
    for attempt in range(4):
        try:
            with urllib.request.urlopen(url, timeout=300) as response:
                data = response.read()
            break
        except OSError as exc:
            if attempt == 3:
                raise
            print(f"fetch {url} failed ({exc}); retrying", file=sys.stderr)
            time.sleep(2**attempt)
    algorithm, _, expected = integrity.partition("-")
    actual = base64.b64encode(hashlib.new(algorithm, data).digest()).decode()
    if actual != expected:
        sys.exit(f"integrity mismatch for {url}: expected {integrity}, got {algorithm}-{actual}")
    print(f"fetched {name}@{version} ({len(data)} bytes, integrity ok)", file=sys.stderr)
    return tarfile.open(fileobj=io.BytesIO(data), mode="r:gz")


def safe_members(archive: tarfile.TarFile, prefix: str):
    for member in archive.getmembers():
        if not member.name.startswith(prefix) or ".." in member.name.split("/"):
            continue
        if member.isfile() or member.isdir():
            yield member, member.name[len(prefix) :]


def install_node(spec: str) -> None:
    archive = fetch(spec)
    member = archive.getmember("package/bin/node")
    target = f"{PREFIX}/bin/node"
    with archive.extractfile(member) as source, open(target, "wb") as sink:
        sink.write(source.read())
    os.chmod(target, 0o755)


def install_npm(spec: str) -> None:
    archive = fetch(spec)
    root = f"{PREFIX}/lib/node_modules/npm"
    for member, relative in safe_members(archive, "package/"):
        path = os.path.join(root, relative)
        if member.isdir():
            os.makedirs(path, exist_ok=True)
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with archive.extractfile(member) as source, open(path, "wb") as sink:
            sink.write(source.read())
        os.chmod(path, 0o755 if member.mode & 0o111 else 0o644)
    for command, script in (("npm", "npm-cli.js"), ("npx", "npx-cli.js")):
        link = f"{PREFIX}/bin/{command}"
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(f"../lib/node_modules/npm/bin/{script}", link)


if __name__ == "__main__":
    node_spec, npm_spec = sys.argv[1], sys.argv[2]
    install_node(node_spec)
    install_npm(npm_spec)
