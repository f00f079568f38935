"""The files a report writes, in the form the repository commits them: JSON and PNG.

- JSON is compact (no indentation): the report's .md/.txt is what people read, the JSON what programs
  read, and the repository keeps every report.
- Figures are matplotlib's render stored with a 256-colour palette: line plots, bars and text on white
  use fewer colours than that, and the file is about a third of the RGBA one. No dithering, so flat
  colours stay flat.
Both are written to a temporary name and renamed, so a failed write leaves no half file.
"""

from __future__ import annotations

import io
import json
import os

__all__ = ["save_png", "write_json"]


def write_json(obj, path: str, sort_keys: bool = True) -> None:
    """`obj` as one line of compact JSON and a newline at `path` (sort_keys=False keeps the caller's order,
    e.g. recipes as given on the command line)."""
    partial = path + ".partial"
    with open(partial, "w", encoding="utf-8") as f:
        json.dump(obj, f, separators=(",", ":"), sort_keys=sort_keys)
        f.write("\n")
    os.replace(partial, path)


def save_png(fig, path: str, dpi: int) -> None:
    """Writes `fig` to `path` as a palette PNG (through a temporary file, so a failed save leaves no half
    image) and closes it."""
    import matplotlib.pyplot as plt
    from PIL import Image  # matplotlib's own dependency

    rendered = io.BytesIO()
    fig.savefig(rendered, format="png", dpi=dpi)
    plt.close(fig)
    rendered.seek(0)
    image = Image.open(rendered).convert("RGB")
    palette = image.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    partial = path + ".partial"
    palette.save(partial, format="PNG", optimize=True)
    os.replace(partial, path)
