"""Decode speed: kvlab's caches against transformers (see `kvlab bench decode --help`).

    .venv/bin/python bench/decode.py            # writes bench/results/decode.json
"""

from kvlab.cli import app

if __name__ == "__main__":
    app(["bench", "decode"])
