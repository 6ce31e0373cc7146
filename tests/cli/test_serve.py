"""Every `pagoda serve` option reaches what it configures: parsed, then built into the settings and the engine
config exactly as `serve` builds them, and each checked where its value is used: the engine config the engine
reads, the settings the HTTP server reads, the arguments the engine's assembly hands the model loader (a
stand-in stops the load there, so no model is loaded). An option without a row here fails the test."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from pagoda.api.settings import ServeSettings
from pagoda.cli.data_parallel import DataParallelOptions, data_parallel_options
from pagoda.cli.main import build_parser
from pagoda.cli.serve import engine_options, serve_settings
from pagoda.core.engine_config import EngineConfig, SpeculativeConfig
from pagoda.model import hub, loader
from pagoda.model.config import named_config
from pagoda.model.factory import EngineOptions, build_engine, engine_config
from pagoda.model.ranks import group_size
from tests.server_fixtures import write_llama_config

TINY = named_config("tiny")


class Stop(Exception):
    """Raised by a stand-in once the value a row checks has reached it: nothing past it runs."""


def arguments_to(module: Any, name: str, call: Callable[[], Any]) -> tuple[tuple, dict]:
    """The arguments `call` hands `module.name`, whose stand-in stops the call there."""
    seen = []

    def stand_in(*args: Any, **kwargs: Any) -> Any:
        seen.append((args, kwargs))
        raise Stop

    with mock.patch.object(module, name, stand_in), pytest.raises(Stop):
        call()
    return seen[0]


@dataclass
class Built:
    """What one command line becomes."""

    options: EngineOptions
    settings: ServeSettings
    config: EngineConfig
    data_parallel: DataParallelOptions
    model_dir: Path
    args: argparse.Namespace

    def same_as_without(self, option: str) -> bool:
        """Whether the engine options and the server's settings are what the command line makes without `option`."""
        argv = [a for a in self.args.command_line if a != option]
        without = build(argv, self.model_dir)
        return (without.options, without.settings, without.config) == (self.options, self.settings, self.config)

    def resolved_model(self) -> str:
        """The model `build_engine` (what `pagoda serve` calls) asks the hub to resolve."""
        args, _ = arguments_to(hub, "resolve_model", lambda: build_engine(self.options, progress=False))
        return args[0]

    def load(self) -> dict[str, Any]:
        """What the model loader is handed for these options, where `load_engine` loads a model (`load_shard`):
        the device name it resolves, then `load_model`'s keyword arguments (dtype, device, quantization, ...)."""
        devices = []

        def resolve_device(device: Any) -> torch.device:
            devices.append(device)
            return torch.device("cpu")  # what the load then runs on is the next question, not this one

        with mock.patch.object(loader, "resolve_device", resolve_device):
            _, kwargs = arguments_to(loader, "load_model", lambda: loader.load_shard(self.model_dir, self.options))
        return {"device_asked": devices[0], **kwargs}


def write_tiny_config(model_dir: Path) -> None:
    """The tiny Llama's config.json, all `load_shard` reads before it loads weights."""
    write_llama_config(model_dir, TINY)


def build(argv: list[str], model_dir: Path, environ: dict[str, str] | None = None) -> Built:
    args = build_parser().parse_args(["serve", *argv])
    args.command_line = argv
    options = engine_options(args)
    config = engine_config(options, TINY, torch.float32, torch.device("cpu"))
    return Built(options, serve_settings(args, model_dir, environ or {}), config, data_parallel_options(args),
                 model_dir, args)


# option -> (its arguments, what must hold where the value is used: the engine config the engine reads, the
# settings the server reads, what the engine's assembly hands the hub, the loader or the tensor-parallel group)
ROWS: dict[str, tuple[list[str], Callable[[Built], Any]]] = {
    "--model": (["--model", "/models/m"], lambda b: b.resolved_model() == "/models/m"),
    "--host": (["--host", "::1"], lambda b: b.settings.host == "::1"),
    "--port": (["--port", "0"], lambda b: b.settings.port == 0),
    "--device": (["--device", "cpu"], lambda b: b.load()["device_asked"] == "cpu"),
    "--dtype": (["--dtype", "float16"], lambda b: b.load()["dtype"] == torch.float16),
    "--quantization": (["--quantization", "int8"], lambda b: b.load()["quantization"] == "int8"),
    "--block-size": (["--block-size", "32"], lambda b: b.config.block_size == 32),
    "--num-blocks": (["--num-blocks", "77"], lambda b: b.config.num_blocks == 77),
    "--max-running": (["--max-running", "5"], lambda b: b.config.max_running == 5),
    "--max-batched-tokens": (["--max-batched-tokens", "123"], lambda b: b.config.max_batched_tokens == 123),
    "--max-model-len": (["--max-model-len", "100"], lambda b: b.config.max_model_len == 100),
    "--no-prefix-caching": (["--no-prefix-caching"], lambda b: b.config.enable_prefix_caching is False),
    # on by default on the CPU (the config built here); the flag turns it on for CUDA, where the engine config and
    # the loader ask `invariant_on`
    "--batch-invariant": (["--batch-invariant"],
                          lambda b: b.config.batch_invariant and b.options.invariant_on(torch.device("cuda"))),
    "--no-batch-invariant": (["--no-batch-invariant"], lambda b: b.config.batch_invariant is False),
    "--cuda-graphs": (["--cuda-graphs"], lambda b: b.config.cuda_graphs is True),
    "--no-cpu-graphs": (["--no-cpu-graphs"], lambda b: b.config.cpu_graphs is False),
    "--api-key": (["--api-key", "sekret"], lambda b: b.settings.api_key == "sekret"),
    "--api-keys-file": (["--api-keys-file", "keys.toml"], lambda b: b.settings.api_keys_file == "keys.toml"),
    "--disconnect-policy": (["--disconnect-policy", "finish"], lambda b: b.settings.disconnect_policy == "finish"),
    "--tool-parser": (["--tool-parser", "llama3_json"], lambda b: b.settings.tool_parser == "llama3_json"),
    "--send-stall-timeout": (["--send-stall-timeout", "3.5"], lambda b: b.settings.send_stall_timeout == 3.5),
    "--send-buffer-size": (["--send-buffer-size", "4096"], lambda b: b.settings.send_buffer_size == 4096),
    "--max-waiting": (["--max-waiting", "9"], lambda b: b.config.max_waiting == 9),
    "--scheduling-policy": (["--scheduling-policy", "fair"], lambda b: b.config.scheduling_policy == "fair"),
    "--max-body-bytes": (["--max-body-bytes", "1000"], lambda b: b.settings.max_body_bytes == 1000),
    "--max-header-bytes": (["--max-header-bytes", "2000"], lambda b: b.settings.max_header_bytes == 2000),
    "--request-read-timeout": (["--request-read-timeout", "4.5"], lambda b: b.settings.request_read_timeout == 4.5),
    "--max-connections": (["--max-connections", "20"], lambda b: b.settings.max_connections == 20),
    "--generation-config": (["--generation-config", "none"], lambda b: b.settings.generation_defaults == {}),
    "--shutdown-timeout": (["--shutdown-timeout", "7"], lambda b: b.settings.shutdown_timeout == 7),
    "--served-model-name": (["--served-model-name", "a", "b"],
                            lambda b: (b.settings.served_model_name, b.settings.served_model_aliases) == ("a", ("b",))),
    "--allowed-origins": (["--allowed-origins", "https://x.example"],
                          lambda b: b.settings.allowed_origins == ("https://x.example",)),
    "--max-stop-strings": (["--max-stop-strings", "3"], lambda b: b.settings.request_limits.max_stop == 3),
    "--max-stop-length": (["--max-stop-length", "40"], lambda b: b.settings.request_limits.max_stop_length == 40),
    "--max-logprobs": (["--max-logprobs", "5"], lambda b: b.settings.request_limits.max_logprobs == 5),
    "--max-output-tokens": (["--max-output-tokens", "64"], lambda b: b.settings.request_limits.max_tokens == 64),
    "--log-level": (["--log-level", "warning"], lambda b: b.settings.log_level == "warning"),
    "--speculative-config": (["--speculative-config", '{"num_speculative_tokens": 2, "max_extra_rows": 4}'],
                             lambda b: b.config.speculative == SpeculativeConfig(num_speculative_tokens=2,
                                                                                 max_extra_rows=4)),
    # `load_engine` sizes the group with `group_size(options.parallel)` and starts the ranks with `options.parallel`
    "--tensor-parallel-size": (["--tensor-parallel-size", "2"], lambda b: group_size(b.options.parallel, {}) == 2),
    "--distributed-backend": (["--distributed-backend", "nccl"], lambda b: b.options.parallel.backend == "nccl"),
    "--distributed-timeout": (["--distributed-timeout", "5"], lambda b: b.options.parallel.timeout_s == 5),
    "--data-parallel-size": (["--data-parallel-size", "3"], lambda b: b.data_parallel.size == 3),
    "--router-policy": (["--router-policy", "least_load"], lambda b: b.data_parallel.router_policy == "least_load"),
    "--disable-plugin": (["--disable-plugin", "tokenize", "chat_page"],
                         lambda b: b.settings.disabled_plugins == ("tokenize", "chat_page")),
    # `load_engine` loads each (name, path) through Engine.load_adapter once the engine is built; vLLM's
    # base_model_name is the parent the server's card of the adapter names
    "--lora-modules": (["--lora-modules", "a=/adapters/a",
                        '{"name": "b", "path": "/adapters/b", "base_model_name": "org/base"}'],
                       lambda b: b.options.lora_modules == (("a", "/adapters/a"), ("b", "/adapters/b"))
                       and b.config.enable_lora and b.settings.lora_parents == (("b", "org/base"),)),
    "--max-loras": (["--max-loras", "3"], lambda b: b.config.max_loras == 3),
    "--max-lora-rank": (["--max-lora-rank", "64"], lambda b: b.config.max_lora_rank == 64),
    "--enable-lora-loading": (["--enable-lora-loading"],
                              lambda b: b.settings.enable_lora_loading is True and b.config.enable_lora),
    # vLLM's spelling, accepted and changing nothing (never taken for --enable-lora-loading: no abbreviations)
    "--enable-lora": (["--enable-lora"], lambda b: b.args.enable_lora and b.same_as_without("--enable-lora")
                      and not b.settings.enable_lora_loading and not b.config.enable_lora),
}


def serve_options() -> set[str]:
    """Every long option `pagoda serve` takes (its parser's own, --help aside)."""
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    parser = sub.choices["serve"]
    return {s for action in parser._actions for s in action.option_strings if s.startswith("--")} - {"--help"}


def test_every_option_has_a_row():
    assert serve_options() == set(ROWS)


@pytest.mark.parametrize("option", sorted(ROWS))
def test_the_option_lands_where_it_belongs(option, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))  # a model that has defaults
    write_tiny_config(tmp_path)
    argv, holds = ROWS[option]
    default = build([], tmp_path)
    assert not holds(default), f"{option}: the row's check already holds without the option"  # the row can fail
    assert holds(build(argv, tmp_path)), f"{option} {argv} did not reach what it configures"


def test_serve_takes_no_abbreviation_of_an_option(tmp_path, capsys):
    """An abbreviation would let another server's flag pass for a prefix of one of pagoda's (vLLM's --enable-lora
    for --enable-lora-loading, before it was a flag of its own)."""
    for argv in (["--enable-lora-load"], ["--max-lora-r", "8"], ["--served-model", "m"]):
        with pytest.raises(SystemExit):
            build(argv, tmp_path)
        assert "unrecognized arguments" in capsys.readouterr().err


def test_the_defaults_are_the_engine_configs_and_the_settings(tmp_path):
    built = build([], tmp_path)
    engine, settings = EngineConfig(), ServeSettings()
    for name in ("block_size", "max_running", "max_batched_tokens", "enable_prefix_caching", "max_waiting",
                 "speculative"):
        assert getattr(built.config, name) == getattr(engine, name), name
    for name in ("host", "port", "log_level", "disconnect_policy", "tool_parser", "send_stall_timeout",
                 "max_body_bytes", "max_header_bytes", "shutdown_timeout", "request_limits", "disabled_plugins",
                 "request_read_timeout", "max_connections"):
        assert getattr(built.settings, name) == getattr(settings, name), name


def test_the_key_comes_from_the_environment_and_the_tool_parser_may_be_none(tmp_path):
    assert build([], tmp_path, {"PAGODA_API_KEY": "from-env"}).settings.api_key == "from-env"
    assert build(["--tool-parser", "none"], tmp_path).settings.tool_parser is None


def test_the_generation_defaults_come_from_the_model_unless_turned_off(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9}))
    assert build([], tmp_path).settings.generation_defaults == {"temperature": 0.6, "top_p": 0.9}
    assert build(["--generation-config", "none"], tmp_path).settings.generation_defaults == {}
    assert build([], tmp_path).settings.served_model_name == "default"
    assert build(["--model", str(tmp_path)], tmp_path).settings.served_model_name == tmp_path.name
    # a GGUF file is served under its own name, not its import's cache directory's
    assert build(["--model", str(tmp_path / "Qwen3-0.6B-Q8_0.gguf")], tmp_path).settings.served_model_name == "Qwen3-0.6B-Q8_0"


@pytest.mark.slow
def test_serve_states_the_speculation_in_force_at_start_up_and_in_health(tiny_model_dir):
    """A real `pagoda serve` child on an ephemeral port: what it prints before it listens, what /health says."""
    import subprocess
    import sys

    import httpx

    from pagoda.bench.serve.server import READY, stop_child

    cmd = [sys.executable, "-m", "pagoda", "serve", "--model", str(tiny_model_dir), "--port", "0", "--dtype",
           "float32", "--num-blocks", "64", "--log-level", "warning"]
    log = open(tiny_model_dir.parent / "serve.log", "w+")
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        lines = []
        for line in child.stdout:  # ends when the child exits; the ready line ends the wait
            lines.append(line)
            if READY.search(line):
                break
        assert READY.match(lines[0]), lines  # stdout's first line is still the URL (the contract)
        log.seek(0)
        said = log.read()  # stderr, written before the server listened
        assert "pagoda serve: speculative decoding on: ngram" in said, said
        url = READY.search(lines[-1]).group(1)
        health = httpx.get(f"{url}/health", timeout=30).json()
        assert health["speculation"]["active"] is True and health["speculation"]["reason"] in said
    finally:
        stop_child(child, log)


@pytest.mark.parametrize("flag", ["--batch-invariant", "--no-batch-invariant"])
def test_serve_states_the_batch_invariance_path_at_start_up_in_health_and_on_the_card(tiny_model_dir, flag):
    """The path the start-up probe took (or that it is off) on stderr, in /health and on /v1/models' card."""
    import subprocess
    import sys

    import httpx

    from pagoda.bench.serve.server import READY, stop_child

    cmd = [sys.executable, "-m", "pagoda", "serve", "--model", str(tiny_model_dir), "--port", "0", "--dtype",
           "float32", "--num-blocks", "64", "--log-level", "warning", flag]
    log = open(tiny_model_dir.parent / f"serve{flag}.log", "w+")
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        lines = []
        for line in child.stdout:
            lines.append(line)
            if READY.search(line):
                break
        log.seek(0)
        said = log.read()
        url = READY.search(lines[-1]).group(1)
        health = httpx.get(f"{url}/health", timeout=30).json()
        card = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
        on = flag == "--batch-invariant"
        assert health["batch_invariant"]["on"] is on and card["batch_invariant"]["on"] is on
        assert f"pagoda serve: batch invariance {health['batch_invariant']['why']}" in said, said
        assert ("may depend on the batch" in said) is not on
        assert health["machine"]["cores"] >= 1 and health["machine"]["cpu"] and health["kernels"]["matmul"]
    finally:
        stop_child(child, log)
