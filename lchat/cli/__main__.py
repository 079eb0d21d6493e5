"""``python -m lchat.cli``: the same as the ``lchat`` console script."""

from lchat.cli.main import run

if __name__ == "__main__":
    run()
