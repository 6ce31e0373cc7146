"""`pagoda bench step-parts` as a smoke test: one format, one row, two steps; the parts add up, nothing is timed."""

from pagoda.bench.step_parts import step_parts
from pagoda.bench.weight_formats import load


def test_a_steps_parts_add_up_to_the_step_and_the_wrappers_come_off(default_model_dir):
    model, _ = load(default_model_dir, "float32")
    layer = model.model.layers[0]
    total, parts = step_parts(model, 1, 2)
    assert total > 0 and abs(sum(parts.values()) - total) < 1e-9
    assert {"linear", "LM head", "attention", "KV write", "norm", "q/k split + RoPE", "prepare"} <= set(parts)
    assert all(t > 0 for name, t in parts.items() if name != "rest")
    assert "forward" not in vars(layer.self_attn.qkv_proj) and "_qkv" not in vars(layer.self_attn)
