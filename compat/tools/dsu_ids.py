"""pytest plugin: write the node ids pytest selected (after its -m / -k deselection) to $DSU_IDS_OUT."""
import os

import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    out = os.environ.get("DSU_IDS_OUT")
    if out:
        with open(out, "w") as f:
            f.writelines(item.nodeid + "\n" for item in items)
