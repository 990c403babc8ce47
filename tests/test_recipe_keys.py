"""Every key a recipe or a config-group file sets is read by some code: a key that nothing reads is a bug (it looks
like a setting and changes nothing). Read means an attribute access `.key` in flashtrain/ or launch.py outside the
configs' own `__post_init__` checks; every recipe also composes against the typed schemas (unknown keys fail)."""

import ast
from pathlib import Path

import pytest
import yaml

from hydra_config import compose_config

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.relative_to(ROOT / "recipes").with_suffix("").as_posix() for p in (ROOT / "recipes").rglob("*.yaml"))
# conf/accelerate/ holds accelerate launch's config files (--config_file), not Hydra groups: checked against accelerate.
# Nested groups (conf/model/attention/) are groups too.
GROUP_FILES = sorted(p for p in [*(ROOT / "conf").glob("*/*.yaml"), *(ROOT / "conf").glob("*/*/*.yaml")]
                     if p.parent.name != "accelerate")
ACCELERATE_FILES = sorted((ROOT / "conf" / "accelerate").glob("*.yaml"))
NOT_SETTINGS = {"defaults", "hydra"}  # Hydra's own keys


def attributes_read() -> set[str]:
    """Names of every attribute read in the package and launch.py, outside __post_init__ (validation is no use)."""
    names = set()
    for path in [*sorted((ROOT / "flashtrain").rglob("*.py")), ROOT / "launch.py"]:
        tree = ast.parse(path.read_text())
        checks = {id(node) for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef) and fn.name == "__post_init__"
                  for node in ast.walk(fn)}
        names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and id(node) not in checks}
    return names


def keys_set(node, prefix: str = "") -> list[str]:
    """Dotted leaf keys of a YAML mapping."""
    keys = []
    for key, value in node.items():
        if prefix == "" and key in NOT_SETTINGS:
            continue
        dotted = f"{prefix}{key}"
        keys += keys_set(value, dotted + ".") if isinstance(value, dict) and value else [dotted]
    return keys


READ = attributes_read()


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_key_is_read(recipe):
    compose_config(["name=x", f"recipe={recipe}"])
    text = yaml.safe_load((ROOT / "recipes" / f"{recipe}.yaml").read_text())
    unread = [key for key in keys_set(text) if key.split(".")[-1] not in READ]
    assert not unread, f"recipes/{recipe}.yaml sets keys that no code reads: {unread}"


@pytest.mark.parametrize("path", GROUP_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_config_group_key_is_read(path):
    unread = [key for key in keys_set(yaml.safe_load(path.read_text())) if key.split(".")[-1] not in READ]
    assert not unread, f"{path.relative_to(ROOT)} sets keys that no code reads: {unread}"


@pytest.mark.parametrize("path", ACCELERATE_FILES, ids=lambda p: p.name)
def test_every_accelerate_config_key_is_accelerates(path):
    """accelerate launch reads every key: its config class takes the top-level keys (an unknown one is a TypeError),
    and every fsdp_config key is one of its launch options."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    config = load_config_from_file(str(path))
    options = {action.dest for action in launch_command_parser()._actions}
    unknown = [key for key in (config.fsdp_config or {}) if key not in options]
    assert not unknown, f"{path.relative_to(ROOT)}: fsdp_config keys that accelerate launch does not know: {unknown}"
    assert config.compute_environment.value == "LOCAL_MACHINE" and config.num_processes >= 1


def test_the_check_sees_an_unread_key():
    assert "lr" in READ and "sample_prompt" in READ
    assert keys_set({"trainer": {"sample_tokens": 0}, "defaults": []}) == ["trainer.sample_tokens"]
    assert "never_read_anywhere" not in READ
