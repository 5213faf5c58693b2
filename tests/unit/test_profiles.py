import pytest

from pvisor_host.errors import UsageError
from pvisor_host.models import profiles
from pvisor_host.models.profiles import AgentProfile, NpmInstall, UnavailableInstall


def test_shipped_profiles_load_and_pin_pvisor_versions():
    shipped = profiles.all_profiles()
    assert shipped["claude-code"].version == "2.1.220"
    assert shipped["codex"].version == "0.149.0"
    assert isinstance(shipped["claude-code"].install, NpmInstall)
    assert shipped["claude-code"].install.package == "@anthropic-ai/claude-code"
    assert shipped["codex"].continuation.api == "responses"
    for profile in shipped.values():
        assert profile.pvisor_profile.startswith(f"{profile.agent}/{profile.version}/")


@pytest.mark.parametrize(
    ("agent", "output", "ok"),
    [
        ("claude-code", "2.1.220 (Claude Code)", True),
        ("claude-code", "2.1.220 (Claude Code)\n", True),
        ("claude-code", "2.1.219 (Claude Code)", False),
        ("claude-code", "2.1.220 (Claude Code)\nextra", False),
        ("codex", "codex-cli 0.149.0", True),
        ("codex", "codex-cli 0.148.0", False),
    ],
)
def test_version_probe(agent, output, ok):
    assert profiles.get_profile(agent).version_probe.matches(output) is ok


def test_unknown_agent_names_the_known_ones():
    with pytest.raises(UsageError) as caught:
        profiles.get_profile("gemini")
    assert (
        caught.value.one_line()
        == "unknown agent 'gemini' (known agents: claude-code, codex, mini-swe-agent, opencode, openhands, pi-agent, "
        "swe-agent)"
    )


def test_profile_file_must_match_its_agent():
    from importlib import resources

    text = resources.files("pvisor_host.adapters").joinpath("codex.toml").read_text()
    assert profiles._load("codex.toml", text).agent == "codex"
    with pytest.raises(UsageError, match="declares agent 'codex'; the file must be named after it"):
        profiles._load("other.toml", text)
    with pytest.raises(UsageError, match="agent profile broken.toml is invalid"):
        profiles._load("broken.toml", text.replace('version = "0.149.0"', "version = [1]"))


def test_install_kind_is_a_discriminated_union():
    data = profiles.all_profiles()["codex"].model_dump()
    data["install"] = {"kind": "unavailable", "reason": "not published"}
    profile = AgentProfile.model_validate(data)
    assert isinstance(profile.install, UnavailableInstall)
    assert not profile.installable
    data["install"] = {"kind": "apt", "package": "x"}
    with pytest.raises(ValueError, match="does not match any of the expected tags"):
        AgentProfile.model_validate(data)


def test_relative_entrypoint_is_rejected():
    data = profiles.all_profiles()["codex"].model_dump()
    data["entrypoint"] = "bin/codex"
    with pytest.raises(ValueError, match="absolute"):
        AgentProfile.model_validate(data)
