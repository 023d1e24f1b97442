"""Built-in model families. Each module is an ordinary poros plugin (see poros.registry).

May import: the core only (a family is a plugin like any third-party one).
"""
