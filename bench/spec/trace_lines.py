"""The lines of a tracing log (colour codes stripped) that match a pattern,
for the session-55 trace scripts (draft_confidence.py, draft_top.py)."""
import re

COLOUR = re.compile(r"\x1b\[[0-9;]*m")


def matches(path, pattern):
    """Yields the match of `pattern` in each line of `path` that has one."""
    pattern = re.compile(pattern)
    for line in open(path):
        m = pattern.search(COLOUR.sub("", line))
        if m:
            yield m
