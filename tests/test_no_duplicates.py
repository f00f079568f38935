"""No block of six or more lines is written twice inside fp4jax/ (as a duplicate-code tool reports it).

Lines are normalised (surrounding whitespace stripped); blank lines, comments and docstrings are skipped,
and so are imports and function signatures, which modules share by nature (keyword lists passed on).
A repeated block is reported once, as the pair of places with its length.
"""

import ast
import io
import pathlib
import tokenize

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "fp4jax"
MIN_LINES = 6


def code_lines(source: str) -> list[tuple[int, str]]:
    """(line number, normalised text) of the lines that count."""
    skip = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                skip.update(range(body[0].lineno, body[0].end_lineno + 1))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):  # as pylint's ignore-signatures
            skip.update(range(node.lineno, node.body[0].lineno))
        if isinstance(node, ast.Import | ast.ImportFrom):
            skip.update(range(node.lineno, node.end_lineno + 1))
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    comments = {t.start[0] for t in tokens if t.type == tokenize.COMMENT}
    lines = []
    for number, text in enumerate(source.splitlines(), 1):
        text = text.strip()
        if text and number not in skip and not (text.startswith("#") and number in comments):
            lines.append((number, text))
    return lines


def repeats(files: dict[str, str], min_lines: int = MIN_LINES) -> list[tuple[str, int, str, int, int]]:
    """(file a, line a, file b, line b, length) for each maximal block of >= min_lines equal code lines
    found twice (in one file or two)."""
    lines = {name: code_lines(text) for name, text in files.items()}
    seen, found, covered = {}, [], set()
    for name in sorted(lines):
        for i in range(len(lines[name]) - min_lines + 1):
            key = tuple(text for _, text in lines[name][i : i + min_lines])
            if key in seen and (name, i) not in covered:
                other, j = seen[key]
                length = min_lines
                a, b = lines[other], lines[name]
                while j + length < len(a) and i + length < len(b) and a[j + length][1] == b[i + length][1]:
                    length += 1
                if (other, j) != (name, i) and not (other == name and j + length > i):
                    found.append((other, a[j][0], name, b[i][0], length))
                    covered.update((name, k) for k in range(i, i + length - min_lines + 1))
            seen.setdefault(key, (name, i))
    return found


def test_the_finder_reports_a_repeated_block_once():
    block = "".join(f"x{k} = f({k})\n" for k in range(7))
    files = {"a.py": '"""doc"""\nimport os\n' + block + "y = 1\n", "b.py": "# c\n\n" + block}
    files["c.py"] = block[:40]
    assert repeats(files) == [("a.py", 3, "b.py", 3, 7)]


def fp4jax_repeats():
    files = {str(p.relative_to(PACKAGE.parent)): p.read_text(encoding="utf-8") for p in PACKAGE.rglob("*.py")}
    return repeats(files)


def test_no_block_of_six_lines_is_repeated_inside_fp4jax():
    found = fp4jax_repeats()
    message = "; ".join(f"{a}:{la} and {b}:{lb} ({n} lines)" for a, la, b, lb, n in found)
    assert not found, f"repeated blocks (write each once): {message}"
