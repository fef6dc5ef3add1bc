"""The benchmark's memory measurement: chunked vs naive peak memory above inputs.

Same method as `python -m tephra.kernels.bench` (a fresh subprocess per method, peak RSS minus
the RSS after the inputs), at a smaller vocabulary than the 2048 x 512 x 151936 acceptance
shape, with a chunk holding the same ~3% of the tokens that the auto chunk size gives there.
No times are asserted: the machine is shared.
"""

import json

from tephra.kernels.bench import Record, format_table, run_shape


def test_chunked_peak_memory_is_a_small_fraction_of_naive(tmp_path):
    records = run_shape(
        (512, 128, 16384),
        "float32",
        ["naive", "chunked"],
        "cpu",
        threads=1,
        chunk_size=16,
        workdir=tmp_path,
    )
    naive, chunked = records
    assert (naive["method"], chunked["method"]) == ("naive", "chunked")
    assert set(Record.__dataclass_fields__) == set(chunked)
    json.dumps(records)
    # naive holds several [512, 16384] fp32 buffers (32 MiB each)
    assert naive["peak_memory_bytes_above_inputs"] > 3 * 512 * 16384 * 4
    ratio = chunked["peak_memory_bytes_above_inputs"] / naive["peak_memory_bytes_above_inputs"]
    assert ratio <= 0.15, format_table(records)
    for key in ["logprob", "entropy", "grad_hidden", "grad_weight"]:
        assert chunked[f"max_abs_err_{key}"] <= 1e-4, format_table(records)
    assert "| 512 x 128 x 16384 | float32 | chunked |" in format_table(records)
