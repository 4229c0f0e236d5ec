"""What prepare.py reads and checks a corpus against: sources, downloads, the validation hold-out,
the tasks' formats (GSM8K, skills-pack rows, the hub's multiple choice), n-gram contamination."""
