"""The plugin's config: keyword arguments <-> the "key:value,..." string the C API takes."""

from __future__ import annotations

from typing import Any, Mapping

DEFAULT_POLICY = "pymemplan"
# Keys the plugin handles itself; every other key belongs to the policy (and the plugin
# rejects an unknown one, listing the valid keys).
PLUGIN_KEYS = ("oom_action",)
OOM_ACTIONS = ("raise", "null")


def format_value(value: Any) -> str:
    # The core spells booleans True/False (it also accepts true/1, false/0).
    if isinstance(value, bool):
        return "True" if value else "False"
    return str(value).strip()


def split_items(text: str) -> list[str]:
    """"a:1,b:[256:1,>:4]" -> ["a:1", "b:[256:1,>:4]"]: split at the commas outside
    brackets, as PyTorch reads a list value (roundup_power2_divisions)."""
    items, depth, item = [], 0, ""
    for ch in text + ",":
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth <= 0:
            items.append(item)
            item = ""
        else:
            item += ch
    return items


def format_config(config: Mapping[str, Any]) -> str:
    """{"max_split_size_mb": 512, "oom_action": "null"} -> "max_split_size_mb:512,oom_action:null"."""
    items = []
    for key, value in config.items():
        text = format_value(value)
        is_list = text.startswith("[") and text.endswith("]")
        if not text or (not is_list and ("," in text or ":" in text)):
            raise ValueError(
                f"allocator config: bad value {value!r} for {key!r}: a value cannot be empty "
                "or contain ',' or ':' (but a list in brackets, as PyTorch's "
                "roundup_power2_divisions:[256:1,>:4])")
        items.append(f"{key}:{text}")
    return ",".join(items)


def parse_config(text: str) -> tuple[str | None, dict[str, str]]:
    """"policy:torch,max_split_size_mb:256" -> ("torch", {"max_split_size_mb": "256"}).

    The syntax of PYMEMPLAN_ALLOC_CONF (that of PYTORCH_CUDA_ALLOC_CONF); the optional
    `policy` key selects the policy. Values stay strings: the plugin validates them.
    """
    policy = None
    config: dict[str, str] = {}
    for item in split_items(text):
        item = item.strip()
        if not item:
            continue
        key, colon, value = item.partition(":")
        key, value = key.strip(), value.strip()
        if not colon or not key or not value:
            raise ValueError(f"{item!r} is not of the form key:value")
        if key in config or (key == "policy" and policy is not None):
            raise ValueError(f"{key!r} is given twice")
        if key == "policy":
            policy = value
        else:
            config[key] = value
    return policy, config


def canonical(policy: str, config: Mapping[str, Any]) -> tuple[str, str, str]:
    """(policy, the full effective policy config, oom_action), to compare two configs.

    enable() and enable(release_before_grow=True) ask for the same allocator; comparing
    the effective configs, defaults filled in, says so where comparing the text would not.
    """
    values = {k: format_value(v) for k, v in config.items()}
    oom_action = values.pop("oom_action", "raise")
    text = format_config(values)
    try:
        from .. import _core

        text = _core.parse_config(policy, text)
    except Exception:  # an invalid config, or no _core: compare what was asked, sorted
        text = ",".join(sorted(split_items(text)))
    return policy, text, oom_action
