"""``python -m poros`` is the ``poros`` command: what ``torchrun ... -m poros train`` starts on every rank.

May import: poros.cli.
"""

if __name__ == "__main__":
    from poros.cli.main import main

    raise SystemExit(main())
