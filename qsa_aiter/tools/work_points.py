"""The work points (docs/benchmarks.md), declared once for the benchmarks, the tuner and the warm-up.

A work point is a batch shape of the model's serving path: requests x query rows per request at a context length,
in one phase. The benchmarks (``python -m qsa_aiter bench``, ``benchmarks/*.py``) and the tuner time the points
``work_points()`` lists; the warm-up compiles the plans that launches at ``warm_points(phase)`` make. Both lists
come from ``WORK_POINTS``: a point the benchmarks do not time (``timed=False``) or that the warm-up does not plan
for (``warmed=False``) says so there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

K = 1024

#: The model's index shapes (README.md, "What the op computes"): 4 index heads of head_dim 128, R = 4, and its token
#: top-k budget (2048 tokens: 512 groups).
HEADS, HEAD_DIM, COMPRESS_RATIO, TOKEN_TOPK = 4, 128, 4, 2048
#: The points of the selection targets (docs/selection.md), which the selection benchmarks time by default.
SELECTION_POINTS = ("9x4@64K-128K", "16x4@32K", "64x4@32K", "64x4@98K", "4x4@262K", "64x1@32K", "16x1@98K",
                    "1x1@262K", "128x1@98K", "prefill 4096@32K", "prefill 16K@96K")


@dataclass(frozen=True)
class WorkPoint:
    """One batch shape: request ``r`` has ``context_lens[r]`` tokens and its last ``rows_per_request`` positions
    are queried, in ``phase``."""

    name: str
    context_lens: tuple[int, ...]
    rows_per_request: int
    phase: str
    # The project's targets (page 64, bf16; docs/benchmarks.md): a time ceiling in µs and/or a floor in % of copy
    # bandwidth.
    target_us: float | None = None
    target_pct: float | None = None
    #: The longest context the point's lengths are drawn under (a mixed point's range end); default their maximum.
    context_limit: int | None = None
    timed: bool = True  # in ``work_points()``: the benchmarks and the tuner time it
    warmed: bool = True  # in ``warm_points()``: the warm-up compiles what its launches need
    slow: bool = False  # left out by ``work_points(quick=True)`` (``bench --quick``)

    @property
    def requests(self) -> int:
        return len(self.context_lens)

    @property
    def longest_context(self) -> int:
        """The context (tokens) the point's widest page table holds: what the warm-up plans its launches for."""
        return self.context_limit or max(self.context_lens)


def _mixed(lo: int, hi: int, n: int, seed: int) -> tuple[int, ...]:
    """``n`` context lengths drawn uniformly from ``[lo, hi]`` with ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(int(x) for x in torch.randint(lo, hi + 1, (n,), generator=gen))


#: Every work point, in the order the benchmarks print them, with the project's targets (docs/benchmarks.md). The
#: serving path's points are timed and warmed; 128x1@98K and prefill 4096@32K (points with targets) are timed only,
#: and the 32K-row prefill (the engine's largest chunk) is warmed only.
WORK_POINTS = (
    WorkPoint("9x4@64K-128K", tuple(64 * K + i * 8 * K for i in range(9)), 4, "verify", target_pct=80),
    WorkPoint("16x4@32K", (32 * K,) * 16, 4, "verify", target_us=9.5),
    WorkPoint("64x4@32K", (32 * K,) * 64, 4, "verify"),
    WorkPoint("64x4@98K", (98 * K,) * 64, 4, "verify", target_pct=95),
    WorkPoint("4x4@262K", (262 * K,) * 4, 4, "verify", target_us=15),
    WorkPoint("64x1@32K", (32 * K,) * 64, 1, "decode", target_pct=90),
    WorkPoint("16x1@98K", (98 * K,) * 16, 1, "decode"),
    WorkPoint("1x1@262K", (262 * K,), 1, "decode", target_us=6.5),
    WorkPoint("128x1@98K", (98 * K,) * 128, 1, "decode", target_pct=90, warmed=False),
    WorkPoint("128x1@8K-200K", _mixed(8 * K, 200 * K, 128, 0), 1, "decode", context_limit=200 * K),
    WorkPoint("prefill 4096@32K", (32 * K,), 4096, "prefill", target_us=90, warmed=False),
    WorkPoint("prefill 16K@96K", (96 * K,), 16 * K, "prefill", slow=True),
    WorkPoint("prefill 32K@32K", (32 * K,), 32 * K, "prefill", timed=False),
)


def work_points(quick: bool = False) -> list[WorkPoint]:
    """The points the benchmarks and the tuner time, in order; ``quick`` leaves out the slow ones."""
    return [p for p in WORK_POINTS if p.timed and not (quick and p.slow)]


def points_named(names: str) -> list[WorkPoint]:
    """The timed work points named in ``names`` (comma-separated), in work-point order; ``ValueError`` names any
    that do not exist."""
    wanted = names.split(",")
    points = work_points()
    unknown = set(wanted) - {p.name for p in points}
    if unknown:
        raise ValueError(f"no work point named {', '.join(sorted(unknown))}")
    return [p for p in points if p.name in wanted]


def point_named(name: str) -> WorkPoint:
    """The timed work point called ``name``; ``ValueError`` if there is none."""
    return points_named(name)[0]


def warm_points(phase: str) -> list[WorkPoint]:
    """The points whose launches in ``phase`` the warm-up compiles: a draft step has a decode step's shape (one row
    per request), so draft plans for the decode points."""
    of = "decode" if phase == "draft" else phase
    return [p for p in WORK_POINTS if p.warmed and p.phase == of]


def rows_per_request(phase: str) -> int | None:
    """The rows per request every warmed point of ``phase`` has (4 in verify, 1 in draft and decode), or None where
    they differ (prefill chunks): what a tuned row's bucket of rows is split by to make a point of ``phase``."""
    counts = {p.rows_per_request for p in warm_points(phase)}
    return counts.pop() if len(counts) == 1 else None
