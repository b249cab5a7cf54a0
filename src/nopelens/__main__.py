"""``python -m nopelens``: the ``nopelens`` command."""

from nopelens.analyses.cli import main

if __name__ == "__main__":  # importing this module (as the API reference's builder does) runs nothing
    raise SystemExit(main())
