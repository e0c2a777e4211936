"""A progress bar: tqdm when it is installed, else a minimal one on stderr."""
from __future__ import annotations

import sys


class _Plain:
    def __init__(self, total, desc, disable):
        self.total, self.n, self.desc, self.disable = total, 0, desc, disable
        self.postfix = ""

    def update(self, n=1):
        self.n += n
        if not self.disable:
            w = 30
            done = int(w * self.n / max(self.total, 1))
            sys.stderr.write(f"\r{self.desc}: [{'#' * done}{'.' * (w - done)}] {self.n}/{self.total} {self.postfix}")
            sys.stderr.flush()

    def set_postfix_str(self, s):
        self.postfix = s

    def write(self, s):
        if not self.disable:
            sys.stderr.write("\r")
        print(s, flush=True)

    def close(self):
        if not self.disable:
            sys.stderr.write("\n")


def bar(total, desc, disable=False):
    try:
        from tqdm import tqdm
    except ImportError:
        return _Plain(total, desc, disable)
    return tqdm(total=total, desc=desc, disable=disable, unit="step", dynamic_ncols=True, file=sys.stderr)
