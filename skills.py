"""
The skills pack: rows a base model is fine-tuned on (sft.jsonl) and judged on (eval.jsonl), and
manifest.json. A row: {"category", "prompt", "answer", "scratchpad", "answer_style"}; the reply is
the answer alone (answer_style direct) or the scratchpad's steps, then the answer on its own line.

    python skills.py --pack_dir=data/skills --sft_rows=1600 --eval_rows=320 --pack_seed=0
    python skills.py --pack_source=my_rows.jsonl --pack_dir=data/mine    # local rows, same schema
    python skills.py --pack_source=gsm8k --pack_dir=data/gsm8k_skills    # train: SFT; test: eval

Row i of a template category c in a split has its own random.Random, seeded from (seed, c, split,
i, draw) by sha256: the pack is the same for any number of workers. Whatever the source, no prompt
repeats and no SFT row holds a word run of an eval row (ngrams.py's, as prepare.py checks the
corpus); a pack short of the rows asked is refused, and nothing is written.
"""

import podgpt  # noqa: F401 -- first: a Ctrl-C while the imports below load is one line
import calendar
import datetime
import hashlib
import itertools
import json
import multiprocessing
import os
import random
import sys
from contextlib import nullcontext

from podgpt.core import configurator
from podgpt.core.util import (MAKE_ROOM, MARK, Folder, disk_full, fail, first_line, run_main,
                              write_atomic, write_json)
from podgpt.corpus.tasks import ANSWER_STYLES, PACK_FIELDS, read_rows
from podgpt.corpus.ngrams import MIN_WORDS, NGRAM, EvalGrams, shared_run
from podgpt.core.tokenizer import reply_text

# --- config
pack_dir = "data/skills"  # the pack's folder: sft.jsonl, eval.jsonl, manifest.json
sft_rows = 1600  # rows to fine-tune on
eval_rows = 320  # rows to judge on, never an SFT row's prompt and none of their word runs in one
answer_style = "scratchpad"  # direct (the answer alone) | scratchpad (steps, then it) | mixed
pack_seed = 0  # the templates' seed: the same seed makes the same pack
pack_source = "templates"  # templates | a .jsonl file of rows in the pack's schema | gsm8k
pack_categories = ""  # the template categories to make, comma-separated ("": all of CATEGORIES)
max_draws = 100  # draws per row before its category counts as run out
pack_workers = 1  # processes making the template rows (the pack is the same for any count)
download_dir = "downloads"  # gsm8k: where a URL download goes (the hub's: its cache)
# --- end config

VERSION = 1  # the generator's: a change to any template makes other rows from the same seed
FILES = {"eval": "eval.jsonl", "sft": "sft.jsonl"}
MANIFEST = "manifest.json"
MAX_ROWS = 1_000_000  # rows a split: far above the templates' reach (a few thousand a category)

WORDS = ("apple banana cherry garden window pencil rocket silver planet mirror castle forest "
         "bottle candle dragon button yellow orange purple marble pepper ladder tunnel rabbit "
         "turtle parrot basket jacket hammer kettle lemon melon river valley island desert summer "
         "winter autumn spring bridge harbor market school doctor farmer sailor pirate wizard "
         "knight artist singer camera pillow blanket carpet cookie muffin butter cheese coffee "
         "teapot saucer spoon").split()
NAMES = "Ava Ben Chloe Dan Ella Finn Grace Hugo Iris Jack Kate Leo Maya Noah Omar Pia".split()
ITEMS = "apples pencils stickers marbles cookies cards stamps shells coins books beads toys".split()
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
ANCHOR = datetime.date(2000, 1, 1)  # a Saturday: weekdays are counted from it


# -----------------------------------------------------------------------------
# The task families: each makes (prompt, answer, scratchpad lines) from a random.Random

def place_parts(n):
    """n by place value, largest first, zeros left out: 3407 -> [3000, 400, 7]."""
    digits = str(n)
    return [int(d) * 10 ** (len(digits) - k - 1) for k, d in enumerate(digits) if d != "0"]


def carries(a, b, sign):
    """Whether a + b (sign 1) carries or a - b (sign -1) borrows in some column."""
    while b:
        if (a % 10 + b % 10 > 9) if sign > 0 else (a % 10 < b % 10):
            return True
        a, b = a // 10, b // 10
    return False


def arithmetic(rng):
    op = rng.choice("+-*")
    if op == "*":
        # b of two nonzero digits: two partial products
        a, b = rng.randint(120, 9999), rng.randint(1, 9) * 10 + rng.randint(2, 9)
        tens, ones = place_parts(b)
        return (f"Compute {a} * {b}.", str(a * b), [f"{a} * {tens} = {a * tens}",
                f"{a} * {ones} = {a * ones}", f"{a * tens} + {a * ones} = {a * b}"])
    while True:
        a, b = rng.randint(1000, 99999), rng.randint(100, 9999)
        if carries(a, b, 1 if op == "+" else -1):
            break
    total, steps = a, []
    for p in place_parts(b):
        new = total + p if op == "+" else total - p
        steps.append(f"{total} {op} {p} = {new}")
        total = new
    return f"Compute {a} {op} {b}.", str(total), steps


def word_problem(rng):
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.randrange(4)
    a, b, c = rng.randint(5, 90), rng.randint(2, 12), rng.randint(3, 25)
    product = f"{b} * {c} = {b * c}"
    if kind == 0:
        d = rng.randint(1, a + b * c - 1)
        return (f"{name} has {a} {item}, buys {b} packs of {c} {item}, then gives away {d}. How "
                f"many {item} are left?", str(a + b * c - d),
                [product, f"{a} + {b * c} = {a + b * c}", f"{a + b * c} - {d} = {a + b * c - d}"])
    if kind == 1:
        a = b * c + rng.randint(1, 60)
        return (f"{name} has {a} {item} and gives {b} to each of {c} friends. How many {item} does "
                f"{name} keep?", str(a - b * c), [product, f"{a} - {b * c} = {a - b * c}"])
    if kind == 2:
        paid = b * c + rng.randint(1, 50)
        return (f"{name} buys {b} {item} at {c} dollars each and pays with {paid} dollars. What is "
                f"the change in dollars?", str(paid - b * c),
                [product, f"{paid} - {b * c} = {paid - b * c}"])
    d = rng.randint(2, 9)
    a += -(a + b * c) % d  # the share is whole
    share = (a + b * c) // d
    return (f"{name} has {a} {item}, buys {b} boxes of {c}, and shares them equally among {d} "
            f"friends. How many {item} does each friend get?", str(share),
            [product, f"{a} + {b * c} = {a + b * c}", f"{a + b * c} / {d} = {share}"])


def counting(rng):
    if rng.random() < 0.5:
        word = rng.choice(WORDS) + rng.choice(WORDS)
        letter = rng.choice(word)
        at = [str(k + 1) for k, ch in enumerate(word) if ch == letter]
        return (f"How many times does the letter '{letter}' appear in '{word}'?", str(len(at)),
                [f"{word}: {' '.join(word)}", f"'{letter}' at positions {', '.join(at)}"])
    items = rng.sample(WORDS, rng.randint(5, 12))
    return (f"How many items are in this list: {', '.join(items)}?", str(len(items)),
            [f"{k + 1}: {w}" for k, w in enumerate(items)])


def sorting(rng):
    if rng.random() < 0.5:
        words = rng.sample(WORDS, rng.randint(4, 7))
        ordered = sorted(words)
        return (f"Sort these words alphabetically: {' '.join(words)}. Give them comma-separated.",
                ",".join(ordered), [f"first letters: {' '.join(w[0] for w in words)}",
                                    f"in order: {' '.join(ordered)}"])
    numbers = rng.sample(range(1, 1000), rng.randint(4, 7))
    down = rng.random() < 0.5
    ordered = sorted(numbers, reverse=down)
    steps = [f"{'largest' if down else 'smallest'} left: {n}" for n in ordered]
    return (f"Sort {', '.join(map(str, numbers))} in {'descending' if down else 'ascending'} "
            "order, comma-separated.", ",".join(map(str, ordered)), steps)


UNITS = [("km", "m", 1000), ("m", "cm", 100), ("cm", "mm", 10), ("kg", "g", 1000),
         ("g", "mg", 1000), ("hours", "minutes", 60), ("minutes", "seconds", 60),
         ("days", "hours", 24), ("weeks", "days", 7)]


def units(rng):
    big, small, factor = rng.choice(UNITS)
    n = rng.randint(2, 999)
    kind = rng.randrange(3)
    rate = f"1 {big} = {factor} {small}"
    if kind == 0:
        return (f"Convert {n} {big} to {small}.", str(n * factor),
                [rate, f"{n} * {factor} = {n * factor}"])
    if kind == 1:
        return (f"Convert {n * factor} {small} to {big}.", str(n),
                [rate, f"{n * factor} / {factor} = {n}"])
    extra = rng.randint(1, factor - 1)
    return (f"How many {small} are {n} {big} and {extra} {small}?", str(n * factor + extra),
            [f"{n} * {factor} = {n * factor}", f"{n * factor} + {extra} = {n * factor + extra}"])


def random_date(rng, first, last):
    start = datetime.date(first, 1, 1)
    return start + datetime.timedelta(rng.randrange((datetime.date(last + 1, 1, 1) - start).days))


def date_add(rng):
    start, days = random_date(rng, 2000, 2030), rng.randint(5, 120)
    day, left, steps = start, days, []
    while True:  # a month at a time: to the first of the next month while the days reach it
        to_next = calendar.monthrange(day.year, day.month)[1] - day.day + 1
        if left < to_next:
            break
        nxt = day + datetime.timedelta(to_next)
        steps.append(f"{day} + {to_next} = {nxt}, {left - to_next} days left")
        day, left = nxt, left - to_next
    end = day + datetime.timedelta(left)
    steps.append(f"{day} + {left} = {end}")
    return f"What date is {days} days after {start}? Answer as YYYY-MM-DD.", end.isoformat(), steps


def weekday(rng):
    day = random_date(rng, 1950, 2049)
    days = (day - ANCHOR).days
    name = WEEKDAYS[(5 + days) % 7]
    return (f"What day of the week was {day}?", name,
            [f"{ANCHOR} was a Saturday", f"{ANCHOR} to {day}: {days} days",
             f"{days} mod 7 = {days % 7}", f"Saturday + {days % 7} days = {name}"])


def month_add(rng):
    """A small family on purpose (552 prompts): a pack asking more of it than that is refused."""
    start, n, sign = rng.randrange(12), rng.randint(1, 23), rng.choice((1, -1))
    end = (start + sign * n) % 12
    first, last = calendar.month_name[start + 1], calendar.month_name[end + 1]
    return (f"What month is {n} months {'after' if sign > 0 else 'before'} {first}?", last,
            [f"{first} is month {start + 1}",
             f"{start + 1} {'+' if sign > 0 else '-'} {n} = {start + 1 + sign * n}",
             f"modulo 12: month {end + 1}, {last}"])


def string_edit(rng):
    kind = rng.randrange(3)
    if kind == 0:
        word = rng.choice(WORDS) + rng.choice(WORDS)
        return (f"Reverse the letters of '{word}'.", word[::-1],
                [f"letters: {' '.join(word)}", f"backwards: {' '.join(word[::-1])}"])
    if kind == 1:
        word = rng.choice(WORDS) + rng.choice(WORDS)
        old, new = rng.choice(word), rng.choice("abcdefghijklmnopqrstuvwxyz")
        at = [str(k + 1) for k, ch in enumerate(word) if ch == old]
        return (f"Replace every '{old}' in '{word}' with '{new}'.", word.replace(old, new),
                [f"'{old}' at positions {', '.join(at)}", f"each becomes '{new}'"])
    words = rng.sample(WORDS, rng.randint(4, 6))
    swapped = [words[-1]] + words[1:-1] + [words[0]]
    return (f"Swap the first and last words of: {' '.join(words)}", " ".join(swapped),
            [f"first: {words[0]}, last: {words[-1]}"])


def yes_no(rng):
    kind = rng.randrange(3)
    if kind == 0:
        n = rng.randint(100, 99999)
        return (f"Is {n} even? Answer as YES or NO.", "YES" if n % 2 == 0 else "NO",
                [f"{n} ends in {n % 10}", f"{n % 10} is {'even' if n % 2 == 0 else 'odd'}"])
    if kind == 1:
        a, b = rng.sample(range(100, 10000), 2)
        return (f"Is {a} greater than {b}? Answer as YES or NO.", "YES" if a > b else "NO",
                [f"{a} - {b} = {a - b}", f"{a - b} is {'positive' if a > b else 'negative'}"])
    word, letter = rng.choice(WORDS) + rng.choice(WORDS), rng.choice("abcdefghijklmnopqrstuvwxyz")
    return (f"Does '{word}' contain the letter '{letter}'? Answer as YES or NO.",
            "YES" if letter in word else "NO",
            [f"{word}: {' '.join(word)}",
             f"'{letter}' {'is' if letter in word else 'is not'} among them"])


def format_list(rng):
    words = rng.sample(WORDS, 3)
    if rng.random() < 0.5:
        return (f"Give the three items {', '.join(words)} comma-separated in uppercase.",
                ",".join(w.upper() for w in words),
                [f"uppercase: {' '.join(w.upper() for w in words)}"])
    return (f"Write {', '.join(words)} in reverse order, separated by ' | '.",
            " | ".join(words[::-1]), [f"last first: {', '.join(words[::-1])}"])


# each category: its family and its chance level, the probability of its exact answer by guessing
CATEGORIES = {
    "arithmetic": (arithmetic, 0.0), "word_problem": (word_problem, 0.0),
    "counting": (counting, 0.0), "sorting": (sorting, 0.0), "units": (units, 0.0),
    "date_add": (date_add, 0.0), "weekday": (weekday, 1 / 7), "month_add": (month_add, 1 / 12),
    "string_edit": (string_edit, 0.0), "yes_no": (yes_no, 0.5), "format": (format_list, 0.0),
}
CHANCE = {"gsm8k": 0.0} | {name: chance for name, (_, chance) in CATEGORIES.items()}


# -----------------------------------------------------------------------------
# Rows, their normal form and their overlap

def normal(text):
    return " ".join(text.lower().split())


class EvalIndex:
    """The eval rows' normalised prompts and word runs (ngrams.EvalGrams, as prepare.py checks the
    corpus), each to the first eval row that has it."""

    def __init__(self, eval_rows):
        self.rows, self.prompts, self.grams = eval_rows, {}, EvalGrams(eval_rows)
        for k, row in enumerate(eval_rows):
            self.prompts.setdefault(normal(row["prompt"]), k)

    def clashes(self, rows):
        """For each row, (the eval row's index, what they share) when it must not be an SFT row,
        else None; the rows' word runs looked up at once."""
        texts = [row["prompt"] + "\n" + reply_text(row) for row in rows]
        found = []
        for row, text, held in zip(rows, texts, self.grams.hits(texts), strict=True):
            if (k := self.prompts.get(normal(row["prompt"]))) is not None:
                found.append((k, "the same prompt"))
            elif held:
                found.append((held[0], f"the words '{shared_run(text, self.rows[held[0]])}'"))
            else:
                found.append(None)
        return found


def overlap(sft_rows, eval_rows):
    """[(SFT row index, eval row index, what they share)] for each SFT row whose prompt is an eval
    prompt or that holds one of its word runs (ngrams.py)."""
    return [(k, *found) for k, found in enumerate(EvalIndex(eval_rows).clashes(sft_rows)) if found]


def fresh(row, seen, index):
    """Whether row's normalised prompt is new to seen (then added) and, given an EvalIndex, the row
    shares nothing with its eval rows (the eval rows are made first)."""
    prompt = normal(row["prompt"])
    if prompt in seen or (index is not None and index.clashes([row])[0]):
        return False
    seen.add(prompt)
    return True


def check_pack(splits, origins):
    """Refuse, naming the first offending pair, a pack whose prompts repeat within or across the
    splits or whose SFT rows hold a word run of an eval row. origins[split][k]: row k's source."""
    for split in ("eval", "sft"):
        seen = {}
        for k, row in enumerate(splits[split]):
            if (first := seen.setdefault(normal(row["prompt"]), k)) != k:
                fail(f"{origins[split][k]} and {origins[split][first]} have the same prompt after "
                     f"normalisation ({row['prompt'][:60]!r}): remove one of them")
    if found := overlap(splits["sft"], splits["eval"]):
        k, e, what = found[0]
        fail(f"SFT row {origins['sft'][k]} and eval row {origins['eval'][e]} share {what}: an eval "
             "row must not be trained on; remove or change one of them")


# -----------------------------------------------------------------------------
# The templates: rows per category, made in any number of processes

def style_of(answer_style, i):
    return ("scratchpad", "direct")[i % 2] if answer_style == "mixed" else answer_style


def category_rows(job):
    """Up to n fresh rows of a category in a split: to the first that max_draws draws can't make."""
    category, split, n, cfg, index = job
    family, rows, seen = CATEGORIES[category][0], [], set()
    for i in range(n):
        for draw in range(cfg["max_draws"]):
            key = f"{cfg['pack_seed']}/{category}/{split}/{i}/{draw}".encode()
            rng = random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "big"))
            prompt, answer, steps = family(rng)
            row = dict(category=category, prompt=prompt, answer=answer,
                       scratchpad="\n".join(steps), answer_style=style_of(cfg["answer_style"], i))
            if fresh(row, seen, index):
                rows.append(row)
                break
        else:
            break
    return rows


def make_split(split, total, names, cfg, index, pool):
    """A split's rows in its fixed order (row 0 of each category of names, then row 1, ...), and
    each category short of its share (total // len(names), the remainder to the first)."""
    asked = [total // len(names) + (k < total % len(names)) for k in range(len(names))]
    jobs = [(name, split, n, cfg, index) for name, n in zip(names, asked)]
    made = pool.map(category_rows, jobs) if pool else [category_rows(job) for job in jobs]
    short = [f"{name} {split.replace('sft', 'SFT')} {len(rows)} of {n}"
             for name, n, rows in zip(names, asked, made) if len(rows) < n]
    return [row for group in itertools.zip_longest(*made) for row in group if row], short


def template_pack(cfg):
    """{split: rows} from the templates; refused, saying what they made, when fewer than asked."""
    names = chosen_categories(cfg.pack_categories)
    settings = {key: cfg[key] for key in ("pack_seed", "answer_style", "max_draws")}
    with multiprocessing.Pool(cfg.pack_workers) if cfg.pack_workers > 1 else nullcontext() as pool:
        evals, short = make_split("eval", cfg.eval_rows, names, settings, None, pool)
        sft, sft_short = make_split("sft", cfg.sft_rows, names, settings, EvalIndex(evals), pool)
    if short + sft_short:
        fail(f"the templates could make only {len(evals)} of {cfg.eval_rows} eval rows, {len(sft)} "
             f"of {cfg.sft_rows} SFT rows unique and apart ({'; '.join(short + sft_short)}) in "
             f"{cfg.max_draws} draws a row: ask for fewer rows (--sft_rows / --eval_rows) or give "
             "another --pack_source")
    return {"eval": evals, "sft": sft}


def chosen_categories(spec):
    names = [name.strip() for name in spec.split(",") if name.strip()] or list(CATEGORIES)
    unknown = [name for name in names if name not in CATEGORIES]
    if unknown:
        fail(f"pack_categories={spec!r}: no category {unknown[0]!r} (the categories: "
             f"{', '.join(CATEGORIES)})", code=2)
    return names


# -----------------------------------------------------------------------------
# Other sources: local JSONL rows, GSM8K

def split_rows(rows, n_eval, n_sft):
    """{split: indexes of rows} by the sha256 of their normalised prompts: the n_eval smallest to
    eval, the next n_sft to SFT (duplicates hash alike: check_pack finds them in the splits)."""
    order = sorted(range(len(rows)), key=lambda k: (
        hashlib.sha256(normal(rows[k]["prompt"]).encode()).hexdigest(), k))
    return {"eval": order[:n_eval], "sft": order[n_eval:n_eval + n_sft]}


def jsonl_pack(cfg):
    """A JSONL file's rows split by split_rows; refused when it holds fewer than asked."""
    rows, origins = read_rows(cfg.pack_source)
    if len(rows) < cfg.eval_rows + cfg.sft_rows:
        fail(f"{cfg.pack_source} holds {len(rows)} rows, fewer than the {cfg.eval_rows} eval and "
             f"{cfg.sft_rows} SFT rows asked: ask for fewer rows (--sft_rows / --eval_rows) or "
             "give another source")
    picks = split_rows(rows, cfg.eval_rows, cfg.sft_rows)
    return ({split: [rows[k] for k in ks] for split, ks in picks.items()},
            {split: [origins[k] for k in ks] for split, ks in picks.items()})


def gsm8k_rows(path):
    """A GSM8K parquet file's problems as pack rows: the answer the number after "####", the
    scratchpad the reasoning lines without their calculator annotations."""
    from podgpt.corpus.sources import read_parquet
    from podgpt.corpus.tasks import gsm8k_answer, gsm8k_plan

    rows = []
    problems = zip(read_parquet(path, "question"), read_parquet(path, "answer"), strict=True)
    for question, solution in problems:
        answer = gsm8k_answer(solution)
        if answer is None:
            fail(f"{path}: an answer without its final '#### <number>' line ({solution[:60]!r}): "
                 "not GSM8K's main config?")
        rows.append(dict(category="gsm8k", prompt=question.strip(), answer=answer,
                         scratchpad=gsm8k_plan(solution)))
    return rows


def gsm8k_pack(cfg):
    """GSM8K through prepare.py's preset: the first eval_rows test problems are the eval rows, the
    first sft_rows training problems apart from every eval row the SFT rows."""
    from podgpt.corpus.download import download
    from podgpt.corpus.sources import preset_urls

    train_url, test_url = preset_urls("gsm8k")
    test = gsm8k_rows(download(test_url, cfg.download_dir))[:cfg.eval_rows]
    for k, row in enumerate(test):
        row["answer_style"] = style_of(cfg.answer_style, k)
    index, seen, sft, left_out = EvalIndex(test), set(), [], 0
    for row in gsm8k_rows(download(train_url, cfg.download_dir)):
        if len(sft) == cfg.sft_rows:
            break
        row["answer_style"] = style_of(cfg.answer_style, len(sft))
        if fresh(row, seen, index):
            sft.append(row)
        else:
            left_out += 1
    print(f"gsm8k: {left_out} training problems left out of SFT, each a repeat or sharing a prompt "
          "or a run of words with an eval row")
    if len(test) < cfg.eval_rows or len(sft) < cfg.sft_rows:
        fail(f"gsm8k gives {len(test)} of {cfg.eval_rows} eval rows and {len(sft)} of "
             f"{cfg.sft_rows} SFT rows (its training problems apart from the eval rows): ask for "
             "fewer rows (--sft_rows / --eval_rows) or give another source")
    splits = {"eval": test, "sft": sft}
    return splits, {split: [f"gsm8k {split} row {k + 1}" for k in range(len(rows))]
                    for split, rows in splits.items()}


# -----------------------------------------------------------------------------
# The pack's folder

def manifest_of(cfg, splits, texts, description):
    counts = {}
    for split in FILES:
        for row in splits[split]:
            counts.setdefault(row["category"], {"sft": 0, "eval": 0})[split] += 1
    return {
        "generator_version": VERSION,
        "seed": cfg.pack_seed,
        "answer_style": cfg.answer_style if cfg.pack_source in ("templates", "gsm8k")
        else "the source's, row by row",
        "source": description,
        "ngram": NGRAM,
        "min_words": MIN_WORDS,  # and a whole eval prompt or reply of MIN_WORDS to NGRAM - 1 words
        "sft_rows_sharing_eval": 0,  # check_pack refuses a pack where one does
        "categories": {name: n | {"chance": CHANCE.get(name)} for name, n in counts.items()},
        "files": {name: {"rows": len(splits[split]),
                         "sha256": hashlib.sha256(texts[split].encode()).hexdigest()}
                  for split, name in FILES.items()},
    }


def hold_pack(cfg, folder):
    """pack_dir held from the start, so a second skills.py on it is refused while this one makes
    its rows: empty, or a pack's files and the mark (else one line, nothing written)."""
    folder.hold()
    own = {MARK, MANIFEST, *FILES.values()}  # a pack's files, and the holding run's mark
    if os.path.isdir(cfg.pack_dir) and (
            foreign := sorted(n for n in os.listdir(cfg.pack_dir) if n not in own)):
        fail(f"pack_dir {cfg.pack_dir} holds what skills.py did not write "
             f"({', '.join(foreign[:3])}): move that out of it, or choose another --pack_dir")
    folder.claim()


def write_pack(cfg, splits, description):
    """The pack into pack_dir (held), each file atomically; the old manifest goes first and the
    new one comes last, so a manifest is only ever beside its own files."""
    texts = {split: "".join(json.dumps({f: row[f] for f in PACK_FIELDS}, ensure_ascii=False)
                            + "\n" for row in rows) for split, rows in splits.items()}
    manifest = manifest_of(cfg, splits, texts, description)
    try:
        if os.path.exists(path := os.path.join(cfg.pack_dir, MANIFEST)):
            os.remove(path)
        for split, name in FILES.items():
            write_atomic(os.path.join(cfg.pack_dir, name), texts[split])
        write_json(os.path.join(cfg.pack_dir, MANIFEST), manifest)
    except OSError as e:  # a full disk, a folder that cannot be written: one line
        fail(f"cannot write the pack into pack_dir={cfg.pack_dir} ({first_line(e)}): "
             + (MAKE_ROOM if disk_full(e) else "choose another --pack_dir"))
    return manifest


def check_args(cfg):
    if not cfg.pack_dir:  # "" would be the current folder, and the user's files in it
        fail("pack_dir is empty: give the pack's folder, e.g. --pack_dir=data/skills", code=2)
    if cfg.answer_style not in ANSWER_STYLES + ("mixed",):
        fail(f"answer_style={cfg.answer_style!r} is not one of direct, scratchpad, mixed", code=2)
    for key in ("sft_rows", "eval_rows"):
        if cfg[key] < 0:
            fail(f"{key}={cfg[key]} must be 0 or more", code=2)
        if cfg[key] > MAX_ROWS:  # checked first: drawing that many would take hours
            fail(f"{key}={cfg[key]} is more than a pack holds (at most {MAX_ROWS:,} rows a "
                 "split): ask for fewer rows (--sft_rows / --eval_rows)", code=2)
    if cfg.max_draws < 1 or cfg.pack_workers < 1:
        fail(f"max_draws={cfg.max_draws} and pack_workers={cfg.pack_workers} must be at least 1",
             code=2)
    if cfg.pack_source not in ("templates", "gsm8k") and not cfg.pack_source.endswith(".jsonl"):
        fail(f"pack_source={cfg.pack_source!r} is not templates, gsm8k or a .jsonl file of rows",
             code=2)
    if cfg.pack_source == "templates":
        chosen_categories(cfg.pack_categories)


def main(argv):
    cfg = configurator.configure(__file__, argv)
    check_args(cfg)
    with Folder(cfg.pack_dir, "pack_dir") as folder:
        hold_pack(cfg, folder)
        splits, origins, description = make_pack(cfg)
        check_pack(splits, origins)
        manifest = write_pack(cfg, splits, description)
    for name, n in manifest["categories"].items():
        chance = "?" if n["chance"] is None else f"{n['chance']:.3g}"
        print(f"{name:>14}: {n['sft']:5d} sft {n['eval']:5d} eval, chance {chance}")
    print(f"wrote {cfg.pack_dir}: {len(splits['sft'])} SFT rows, {len(splits['eval'])} eval rows "
          f"from {description}")


def make_pack(cfg):
    """The pack's rows from its source: ({split: rows}, {split: each row's origin}, description)."""
    if cfg.pack_source == "templates":
        splits = template_pack(cfg)
        origins = {split: [f"{FILES[split]}:{k + 1}" for k in range(len(rows))]
                   for split, rows in splits.items()}
        return splits, origins, (f"templates v{VERSION} "
                                 f"({', '.join(chosen_categories(cfg.pack_categories))})")
    if cfg.pack_source == "gsm8k":
        return *gsm8k_pack(cfg), "gsm8k (openai/gsm8k main: train for SFT, test for eval)"
    return *jsonl_pack(cfg), cfg.pack_source


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
