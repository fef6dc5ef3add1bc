"""The README's "Images (vision-language models)" example runs as written and prints what it says."""

from pathlib import Path

from tephra.core.testing import run_readme_section


def test_readme_images_example_runs():
    printed, claimed = run_readme_section(
        Path(__file__).resolve().parents[1] / "README.md", "## Images (vision-language models)"
    )
    assert printed and printed == claimed[: len(printed)]
