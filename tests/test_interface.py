"""One source of truth: wit/symphony.wit against the host's error table and the C SDK."""
import re
from pathlib import Path

from symphony_os.errors import ErrorCode
from symphony_os.wit import read_wit

ROOT = Path(__file__).resolve().parent.parent
HEADER = (ROOT / "guest_sdk" / "c" / "symphony.h").read_text()


def test_error_table_matches_wit():
    _, cases = read_wit()
    assert [c.replace("-", "_").upper() for c in cases] == [e.name for e in ErrorCode]
    assert [e.value for e in ErrorCode] == list(range(-1, -len(cases) - 1, -1))


def test_c_header_error_codes_match_wit():
    _, cases = read_wit()
    defined = re.findall(r"#define SYM_E\w+ (-\d+)\s+/\* ([\w-]+) \*/", HEADER)
    assert [(int(v), name) for v, name in defined] == [(-(i + 1), c) for i, c in enumerate(cases)]


def test_c_header_imports_match_wit():
    functions, _ = read_wit()
    imports = {name: params for name, params in
               re.findall(r"SYM_IMPORT\((\w+)\) int32_t __sym_\w+\(([^)]*)\);", HEADER)}
    assert set(imports) == {f.core_name for f in functions}
    for f in functions:
        params = [p for p in imports[f.core_name].split(",") if p.strip() and p.strip() != "void"]
        assert len(params) == len(f.params), f"{f.core_name}: header has {params}, WIT has {f.params}"
