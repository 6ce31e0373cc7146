"""The built-in model architectures, each a plugin registered like a third-party package's
(`pagoda_register_architectures`).

The plugin manager knows them by name only (pagoda.plugins.manager.BUILTIN_ARCHITECTURES), so that any process
can leave one out by name; loading the plugins imports none of them. A process that builds a model puts them
on its plugin manager with `register_families`, so one that only speaks the protocols (the router, a client)
imports no family, no model and no torch.
"""

from __future__ import annotations

import pluggy


def register_families(pm: pluggy.PluginManager) -> pluggy.PluginManager:
    """Register the built-in families on `pm`, less those disabled on it (and any registered already); `pm`."""
    from pagoda.model.families import gemma3, llama, mistral, phi3, qwen2, qwen3, qwen3_moe

    families = {"llama": llama, "mistral": mistral, "qwen2": qwen2, "qwen3": qwen3, "gemma3": gemma3, "phi3": phi3,
                "qwen3_moe": qwen3_moe}  # in pagoda.plugins.manager.BUILTIN_ARCHITECTURES' order
    for name, module in families.items():
        if not pm.is_blocked(name) and not pm.has_plugin(name):
            pm.register(module, name=name)
    return pm
