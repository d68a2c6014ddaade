"""docs/hooks/benchmark_pages: a figure on a benchmark page is one its results file can produce."""
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs" / "hooks"))
try:
    import benchmark_pages
finally:
    sys.path.remove(str(ROOT / "docs" / "hooks"))


def test_a_long_list_is_summarised_by_its_median_even_or_odd():
    even = [0.877, 0.935, 0.954, 0.959, 0.962, 0.992, 1.012, 1.033, 1.056, 1.072, 1.086, 1.149]
    assert benchmark_pages._fmt(even) == f"12 values, median {statistics.median(even):.4g}" == "12 values, median 1.002"
    odd = even[:9]
    assert benchmark_pages._fmt(odd) == "9 values, median 0.962"
    assert benchmark_pages._fmt([3, 1, 2]) == "[3, 1, 2]"          # short lists are shown whole
