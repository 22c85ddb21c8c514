"""Plain-text grids: rows of labelled cells, with an optional marked cell.

Used by ``Schedule.__str__`` (rank x step), by ``render_text`` (rank x time)
and by ``validate`` (rank x step with the failing cell in brackets).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_grid"]


def format_grid(
    row_labels: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    corner: str = "",
    mark: tuple[int, int] | None = None,
    mark_row: int | None = None,
    note: str = "",
) -> str:
    """Format ``rows`` as aligned columns under a header of column indices.

    ``mark=(row, column)`` puts that cell in brackets, ``[1B3]``;
    ``mark_row=row`` appends ``<-- note`` to that row (for problems that have
    no cell, such as a missing action). Trailing spaces are stripped.
    """
    num_columns = max((len(row) for row in rows), default=0)
    width = max([len(cell) for row in rows for cell in row] + [len(str(num_columns - 1)), 1])
    label_width = max([len(label) for label in row_labels] + [len(corner)])
    header = corner.ljust(label_width) + "".join(
        " " + str(column).ljust(width) for column in range(num_columns)
    )
    lines = [header.rstrip()]
    for index, (label, row) in enumerate(zip(row_labels, rows)):
        column_marked = mark[1] if mark is not None and mark[0] == index else None
        line = label.ljust(label_width) + _join_cells(row, width, column_marked)
        if mark_row == index or column_marked is not None:
            line += "  <-- " + note if note else "  <--"
        lines.append(line.rstrip())
    return "\n".join(lines)


def _join_cells(row: Sequence[str], width: int, marked: int | None) -> str:
    """Cells separated by one space; the marked one in brackets, ``[1B3]``."""
    parts = []
    for column, cell in enumerate(row):
        if column == marked:
            parts.append("[" + cell + "]" + " " * (width - len(cell)))
        elif marked is not None and column == marked + 1:
            parts.append(cell.ljust(width))
        else:
            parts.append(" " + cell.ljust(width))
    return "".join(parts)
