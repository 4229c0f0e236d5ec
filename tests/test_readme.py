"""README.md starts with the two commands; CI runs the second one verbatim."""
import os

from conftest import ROOT


def readme_commands():
    text = open(os.path.join(ROOT, "README.md")).read()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_readme_opens_with_the_main_job_and_the_tests():
    main_job, tests = readme_commands()
    assert main_job.endswith("bash run.sh") and "pip install -r requirements.txt" in main_job
    assert tests.endswith("python -m pytest") and "requirements-dev.txt" in tests


def test_ci_runs_the_readme_test_command():
    ci = open(os.path.join(ROOT, ".ci", "run")).read().splitlines()
    assert readme_commands()[1] in ci
