"""The docs test's reading of a page: which blocks run, and the `docs-test` directives."""

from __future__ import annotations

import pytest

from tests.docs.docs_blocks import DirectiveError, parse_page

PAGE = """<!-- docs-test: covered-by tests/x/test_y.py::test_z -->
# A page

```python
print("runs")
```

<!-- docs-test: skip multi-node: needs two machines -->
```bash
torchrun --nnodes=2 train.py
```

```text
never runs
```

- in a list:

    ```bash
    echo indented
    ```

<!-- docs-test: expect runs -->
"""


def _page(tmp_path, text):
    path = tmp_path / "page.md"
    path.write_text(text)
    return parse_page(path)


def test_blocks_directives_and_languages(tmp_path):
    page = _page(tmp_path, PAGE)
    assert page.covered_by == "tests/x/test_y.py::test_z"
    assert page.expects == ["runs"]
    assert [b.code for b in page.runnable("python")] == ['print("runs")\n']
    assert [b.code for b in page.runnable("bash")] == ["echo indented\n"]  # dedented
    skipped = [b for b in page.blocks if b.skip_reason]
    assert [b.skip_reason for b in skipped] == ["multi-node: needs two machines"]
    assert [b.lang for b in page.blocks] == ["python", "bash", "text", "bash"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("<!-- docs-test: skip -->\n```bash\necho\n```\n", "needs a reason"),
        ("# t\n<!-- docs-test: covered-by tests/a.py::test_b -->\n", "first line"),
        ("<!-- docs-test: covered-by somewhere -->\n", "tests/<path>.py::<test>"),
        ("<!-- docs-test: expect -->\n", "expect needs"),
        ("<!-- docs-test: skipp typo -->\n", "unknown docs-test directive"),
    ],
)
def test_malformed_directives_are_refused(tmp_path, text, message):
    with pytest.raises(DirectiveError, match=message.replace("(", r"\(")):
        _page(tmp_path, text)


def test_real_data_pages_are_recognised(tmp_path):
    page = _page(tmp_path, "```bash\nfastdata shard folder ../shared/data/x shards/x\n```\n")
    assert page.needs_real_data
    text = "<!-- docs-test: skip long run: 10 minutes -->\n```bash\nls ../shared/data\n```\n"
    assert not _page(tmp_path, text).needs_real_data
