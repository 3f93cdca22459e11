"""One page's Python snippets in one namespace, in document order (started by test_docs_run.py, not a test).

Reads one JSON request per line on stdin, ``{"code": ..., "name": ...}``, runs the code in the page's namespace
(``__name__ == "__main__"``, as a user's script) and answers ``{"ok": bool, "output": str, "error": str}`` on
the file descriptor named by ``argv[1]``, so what the snippets print never mixes with the answers.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback


class _Tee(io.TextIOBase):
    def __init__(self, *streams: io.TextIOBase) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for s in self.streams:
            s.write(text)
        return len(text)

    def flush(self) -> None:
        for s in self.streams:
            s.flush()


def main() -> None:
    answers = os.fdopen(int(sys.argv[1]), "w")
    sys.argv = ["-c"]  # as `python -c`: a Trainer asking for several devices says to use a script, not re-run this
    namespace: dict = {"__name__": "__main__"}
    for request in sys.stdin:
        req = json.loads(request)
        captured = io.StringIO()
        ok, error = True, ""
        try:
            with contextlib.redirect_stdout(_Tee(captured, sys.stdout)), \
                    contextlib.redirect_stderr(_Tee(captured, sys.stderr)):
                exec(compile(req["code"], req["name"], "exec"), namespace)
        except SystemExit as e:
            ok, error = e.code in (0, None), f"SystemExit({e.code!r})"
        except BaseException:  # reported to the test, which fails the block
            ok, error = False, traceback.format_exc()
        answers.write(json.dumps({"ok": ok, "output": captured.getvalue(), "error": error}) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
