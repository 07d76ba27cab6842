"""The command blocks that docs mark for tests: a ```bash block right after an HTML comment marker, which a
test runs verbatim so that the docs cannot drift from what works."""

from __future__ import annotations

import re
from pathlib import Path


def marked_block(doc: Path, marker: str) -> list[str]:
    """The non-empty lines of the ```bash block after `marker` in `doc`."""
    block = re.search(re.escape(marker) + r"\s*```bash\n(.*?)```", doc.read_text(), re.S)
    assert block, f"{doc}: no ```bash block after {marker}"
    return [line for line in block.group(1).splitlines() if line.strip()]
