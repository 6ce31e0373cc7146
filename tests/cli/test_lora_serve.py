"""`pagoda serve --lora-modules`: NAME=PATH or vLLM's JSON form; an adapter refused at start-up ends it with one line
naming the adapter and the field (exit status 2, no traceback): before the model loads when its name is the served
model's or its directory is missing, else where the engine loads it (Engine.load_adapter), tensor parallel too."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagoda.cli.main import main
from pagoda.cli.main import build_parser
from pagoda.cli.serve import lora_modules, lora_parents, serve_settings
from pagoda.core.sampling_params import SamplingParams
from tests.lora_files import save_random_adapter
from tests.server_fixtures import default_model_dir, tiny_model_dir  # noqa: F401  (fixtures)

SERVE_TINY = ["--port", "0", "--dtype", "float32", "--num-blocks", "64", "--log-level", "warning"]


def adapter_for(model_dir, directory, **kw):
    """A peft adapter of the model's shapes (over a transformers Llama of random weights: only shapes matter)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    config = transformers.LlamaConfig.from_pretrained(str(model_dir))
    return save_random_adapter(transformers.LlamaForCausalLM(config), directory, std=0.1, **kw)


def refusal(capsys) -> str:
    """The one line `pagoda serve` said on stderr."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("pagoda serve:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_the_modules_are_name_path_pairs_or_vllms_json():
    assert lora_modules(["a=/x/a", "b=rel/b=c"]) == (("a", "/x/a"), ("b", "rel/b=c"))
    given = ["a=/x/a", '{"name": "s", "path": "/x/s", "base_model_name": "org/m"}', '{"name": "t", "path": "/x/t"}']
    assert lora_modules(given) == (("a", "/x/a"), ("s", "/x/s"), ("t", "/x/t"))
    assert lora_parents(given) == (("s", "org/m"),)  # vLLM's base_model_name: the parent s's card names
    for bad, why in [("a", "NAME=PATH"), ("=/x", "both"), ("a=", "both"), ('{"name": "s"}', '"path"'),
                     ('{"name": "s", "path": "/x", "rank": 8}', "'rank'"), ("{oops", "not JSON"),
                     ('{"name": "s", "path": "/x", "base_model_name": ""}', "base_model_name"),
                     ('{"name": "s", "path": "/x", "base_model_name": 3}', "base_model_name")]:
        with pytest.raises(ValueError, match=why):
            lora_modules([bad])


def test_vllms_enable_lora_is_accepted_and_turns_no_route_on(tmp_path):
    """Once an abbreviation of --enable-lora-loading; now a flag of its own that changes nothing."""
    args = build_parser(["serve"]).parse_args(["serve", "--enable-lora"])
    assert args.enable_lora and not args.enable_lora_loading
    assert serve_settings(args, tmp_path, {}).enable_lora_loading is False


def test_a_missing_directory_ends_start_up_with_one_line_before_the_model_loads(tmp_path):
    """A real `pagoda serve` (the default model is never loaded: the directory is checked first)."""
    cmd = [sys.executable, "-m", "pagoda", "serve", "--port", "0", "--lora-modules", "bad=/nonexistent"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done
    assert done.stdout == "" and "Traceback" not in done.stderr, done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith("pagoda serve:")]
    assert said == ["pagoda serve: LoRA adapter 'bad' (/nonexistent) refused: lora_path '/nonexistent' is not a "
                    "directory [field: lora_path]"], done.stderr


def test_an_adapter_named_as_the_served_model_or_twice_is_refused(tmp_path, capsys):
    argv = ["serve", "--served-model-name", "m", "alias", *SERVE_TINY]
    assert main([*argv, "--lora-modules", f"alias={tmp_path}"]) == 2
    assert "'alias'" in (line := refusal(capsys)) and "[field: lora_name]" in line
    assert main([*argv, "--lora-modules", f"x={tmp_path}", f"x={tmp_path}"]) == 2
    assert "'x' is given twice" in refusal(capsys)
    assert main([*argv, "--lora-modules", f" x={tmp_path}"]) == 2  # a name with white space around it
    assert "lora_name ' x'" in refusal(capsys)


def test_an_adapter_the_engine_refuses_ends_start_up_naming_it_and_the_field(tiny_model_dir, tmp_path, capsys):  # noqa: F811
    big = adapter_for(tiny_model_dir, tmp_path / "big", rank=32, alpha=32)
    good = adapter_for(tiny_model_dir, tmp_path / "good")
    status = main(["serve", "--model", str(tiny_model_dir), *SERVE_TINY,
                   "--lora-modules", f"good={good}", f"big={big}", "--max-lora-rank", "16"])
    assert status == 2
    line = refusal(capsys)
    assert line.startswith(f"pagoda serve: LoRA adapter 'big' ({big}) refused: r 32 is above") and line.endswith(
        "[field: r]"), line


@pytest.mark.slow
def test_start_up_adapters_load_on_every_rank_of_a_tensor_parallel_group(tiny_model_dir, tmp_path):  # noqa: F811
    from pagoda.model.factory import EngineOptions, build_engine

    a = adapter_for(tiny_model_dir, tmp_path / "a", seed=1)
    options = EngineOptions(model=str(tiny_model_dir), device="cpu", dtype="float32", quantization="none",
                            num_blocks=64, max_model_len=512, tensor_parallel_size=2, lora_modules=(("a", str(a)),))
    engine, _, _ = build_engine(options, progress=False)
    try:
        assert list(engine.adapters.snapshot) == ["a"] and engine.adapters.snapshot["a"].path == str(a)
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        answers = {}
        for adapter in ("a", None):
            engine.add_request(str(adapter), list(range(5, 25)), params, adapter=adapter)
            answers[adapter] = [t for out in engine.run() for t in out.new_token_ids]
        assert len(answers["a"]) == len(answers[None]) == 8 and answers["a"] != answers[None]
        engine.audit()
    finally:
        engine.close()
