"""The built-in model architectures, each a plugin registered like a third-party package's
(`pagoda_register_architectures`, listed in pagoda.plugins.manager.BUILTIN_PLUGINS)."""
