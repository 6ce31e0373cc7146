"""`pagoda bench invariance` end to end on the default model, at a small size: both engines step, the JSON names
the machine and the path the probe took."""

import json

import pytest

from pagoda.bench import invariance
from tests.model_fixtures import default_model_dir  # noqa: F401  (session fixture: the imported default model)

pytestmark = pytest.mark.slow


def test_both_engines_step_and_the_json_names_the_machine_and_the_path(default_model_dir, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "inv.json"
    assert invariance.main(["--dtype", "float32", "--rows", "1,4", "--steps", "2", "--prefill", "2",
                            "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["machine"]["cores"] >= 1 and result["machine"]["isa"] is not None
    entry = result["dtypes"]["float32"]
    assert entry["path"].startswith("on:")
    assert set(entry["steps"]) == {"decode 1 rows", "decode 4 rows", "prefill 2 prompts"}
    assert all(s["on_ms"] > 0 and s["off_ms"] > 0 for s in entry["steps"].values())
    assert "on/off" in capsys.readouterr().out
