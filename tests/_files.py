"""Small file helpers shared by the tests (files closed promptly: ResourceWarnings are errors here)."""

import json


def read_json(path):
    with open(path) as fh:
        return json.load(fh)


def read_lines(path):
    with open(path, newline="") as fh:
        return fh.read().splitlines(keepends=True)


def vis_db_content(path):
    """A ``.vis.db``'s content, comparable across writers: ``({node id: {column: value}}, tb_config rows)`` with
    each node's ``stack_id`` replaced by its stack text (stack ids are per-writer numbering)."""
    import sqlite3
    from contextlib import closing

    with closing(sqlite3.connect(path)) as c:
        stacks = dict(c.execute("select id, stack_info from tb_stack"))
        cols = [d[1] for d in c.execute("pragma table_info(tb_nodes)")]
        nodes = {}
        for row in c.execute("select * from tb_nodes"):
            d = dict(zip(cols, row))
            d["stack_id"] = stacks[d["stack_id"]]
            nodes[d["id"]] = d
        return nodes, list(c.execute("select * from tb_config"))
