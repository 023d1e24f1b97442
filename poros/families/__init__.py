"""Built-in model families. Each module is an ordinary poros plugin (see poros.registry)."""
