"""Small file helpers shared by the tests (files closed promptly: ResourceWarnings are errors here)."""

import json


def read_json(path):
    with open(path) as fh:
        return json.load(fh)


def read_lines(path):
    with open(path, newline="") as fh:
        return fh.read().splitlines(keepends=True)
