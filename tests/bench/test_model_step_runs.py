"""bench.model_step's runs: each function's steps back to back, the first of a run apart."""

from __future__ import annotations

from bench.model_step import interleaved_runs, main


def test_runs_take_turns_and_keep_the_first_step_of_each_apart(monkeypatch):
    calls: list[str] = []
    # Each call advances the clock by its own duration: "a" takes 10 s on the first step
    # of a run and 1 s after it, "b" 20 s and 2 s.
    now = [0.0]
    cost = {"a": (10.0, 1.0), "b": (20.0, 2.0)}

    def step(name: str):
        def call() -> None:
            first = not calls or calls[-1] != name
            calls.append(name)
            now[0] += cost[name][0 if first else 1]

        return call

    monkeypatch.setattr("bench.model_step.time.perf_counter", lambda: now[0])
    later, first = interleaved_runs({"a": step("a"), "b": step("b")}, rounds=3, run=4)

    assert calls[:2] == ["a", "b"]  # one warm-up call each
    runs = ["".join(calls[i : i + 4]) for i in range(2, len(calls), 4)]
    # Runs take turns, the order reversed every other round.
    assert runs == ["aaaa", "bbbb", "bbbb", "aaaa", "aaaa", "bbbb"]
    # Medians over the rounds: a run that follows its own function's run starts warm.
    assert first == {"a": 10e3, "b": 20e3}  # ms
    assert later == {"a": 1e3, "b": 2e3}


def test_weight_dtypes_print_bytes_floors_and_speed_against_the_first(monkeypatch, capsys):
    """The issue-27 figures in one run: the baseline layout first, then each model's
    bytes, floor and speed against it (a smoke run: figures are not asserted)."""
    monkeypatch.setattr("bench.model_step.BANDWIDTH_BYTES", 32 << 20)
    monkeypatch.setattr("bench.model_step.RUN", 2)
    argv = ["model_step", "--dtype", "fp32", "--weight-dtypes", "onednn,int8"]
    argv += ["--batches", "1", "--steps", "2", "--prefill", "0", "--skip-transformers"]
    monkeypatch.setattr("sys.argv", argv)
    main()
    out = capsys.readouterr().out
    assert "onednn (onednn)" in out and "int8 (int8_blocks)" in out
    assert "reads   544 MB" in out and "reads   141 MB" in out
    line = next(line for line in out.splitlines() if "speed against" in line)
    assert line.split(": ", 1)[1].startswith("onednn 1.00x, int8 ")


def test_weight_dtypes_take_another_model_shape(monkeypatch, capsys):
    """``--model``: a random-weight shape, so a step's bytes can exceed the CPU's caches;
    the bytes printed are that model's (tiny-llama: a 49,152 x 64 head, 13 MB in fp32)."""
    monkeypatch.setattr("bench.model_step.BANDWIDTH_BYTES", 32 << 20)
    monkeypatch.setattr("bench.model_step.RUN", 2)
    argv = ["model_step", "--model", "random:tiny-llama", "--dtype", "fp32"]
    argv += ["--weight-dtypes", "fp32,bf16", "--batches", "1", "--steps", "2", "--prefill", "0"]
    monkeypatch.setattr("sys.argv", argv)
    main()
    out = capsys.readouterr().out
    assert out.startswith("model random:tiny-llama, dtype torch.float32")
    assert "reads    13 MB" in out and "reads     7 MB" in out


def test_kv_dtypes_time_each_model_over_a_pool_of_each(monkeypatch, capsys):
    """``--kv-dtypes``: one row per (weight dtype, KV dtype), the K/V's bytes in the pool's
    dtype (tiny-llama: 2 layers x K and V x 2 heads x 16 dims, 512 bytes a token in fp32;
    two sequences of 2,048 tokens: 2.1 MB fp32, 1.0 MB bf16)."""
    monkeypatch.setattr("bench.model_step.BANDWIDTH_BYTES", 32 << 20)
    monkeypatch.setattr("bench.model_step.RUN", 2)
    argv = ["model_step", "--model", "random:tiny-llama", "--dtype", "fp32", "--prefill", "0"]
    argv += ["--weight-dtypes", "fp32", "--kv-dtypes", "auto,bf16", "--batches", "2"]
    argv += ["--steps", "2", "--context", "2047"]
    monkeypatch.setattr("sys.argv", argv)
    main()
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if " reads " in line]
    assert [row.split()[:4] for row in rows] == [
        ["fp32", "(fp32_blocks)", "KV", "auto"],
        ["fp32", "(fp32_blocks)", "KV", "bf16"],
    ]
    megabytes = [float(row.split(" reads ")[1].split()[0]) for row in rows]
    assert megabytes[0] - megabytes[1] in (1, 2)  # 1.05 MB less, in whole MB as printed
    line = next(line for line in out.splitlines() if "speed against" in line)
    assert line.split(": ", 1)[1].startswith("fp32 KV auto 1.00x, fp32 KV bf16 ")
