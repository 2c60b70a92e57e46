"""benchmarks/single_stream.py: pagellm's rounds on a tiny synthetic GGUF, and the
llama-bench turn's command, environment and parsing (against a stand-in script that
records what it was given, since CI has no llama.cpp build)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from tests.utils import import_benchmark


def test_rounds_alternate_with_llama_bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pagellm.benchmarks.synthetic_gguf import SHAPES, write_llama_gguf
    from pagellm.model_executor.loader import default_model_path

    bench = import_benchmark("single_stream")
    model = tmp_path / "tiny.gguf"
    write_llama_gguf(str(model), SHAPES["tiny"], "q4_k_m", vocab_from=default_model_path())
    seen = tmp_path / "seen.jsonl"
    fake = tmp_path / "llama-bench"
    fake.write_text(
        "#!/usr/bin/env python3\nimport json, os, sys\n"
        f"open({str(seen)!r}, 'a').write(json.dumps({{'argv': sys.argv[1:], "
        "'omp': sorted(k for k in os.environ if k.startswith(('OMP_', 'GOMP_', 'KMP_')))}) + '\\n')\n"
        "print(json.dumps([{'n_gen': 8, 'avg_ts': 50.0}]))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    for name in [k for k in os.environ if k.startswith(("OMP_", "GOMP_", "KMP_"))]:
        monkeypatch.delitem(bench.compare.USER_ENV, name, raising=False)

    result = bench.run(str(model), 8, 2, str(fake))
    assert result["tokens"] == 8 and len(result["pagellm"]) == 2 and all(r > 0 for r in result["pagellm"])
    assert result["llama_bench"] == [50.0, 50.0]
    ratios = [r / 50.0 for r in result["pagellm"]]
    assert result["median_ratio"] == pytest.approx(sum(ratios) / 2)
    calls = [json.loads(line) for line in seen.read_text().splitlines()]
    assert len(calls) == 2
    for call in calls:
        argv = call["argv"]
        assert argv[:2] == ["-m", str(model)]
        assert argv[argv.index("-n") + 1] == "8" and argv[argv.index("-p") + 1] == "0"
        assert argv[argv.index("-r") + 1] == "1" and argv[argv.index("-o") + 1] == "json"
        assert "-t" in argv and call["omp"] == []  # the peer in the user's environment

    alone = bench.run(str(model), 8, 1, None)
    assert alone["llama_bench"] is None and alone["median_ratio"] is None
    with pytest.raises(ValueError, match="--tokens 3: at least 4"):
        bench.run(str(model), 3, 1, None)
