"""The rank grid is a pure function; checked for every world size 1..64."""

from __future__ import annotations

import pytest

from mpar.errors import ConfigError
from mpar.topology import make_grid


@pytest.mark.parametrize("placement", ["cluster", "spread"])
def test_grid_is_a_bijection_for_all_world_sizes(placement):
    for world in range(1, 65):
        for pp in (d for d in range(1, world + 1) if world % d == 0):
            grid = make_grid(world, pp, placement)
            assert grid.dp_size * pp == world
            seen = set()
            for rank in range(world):
                p, d = grid.coords(rank)
                assert grid.rank_of(p, d) == rank
                seen.add((p, d))
            assert len(seen) == world
            # pipelines partition the world; so do data-parallel groups
            assert sorted(r for g in grid.pp_groups for r in g) == list(range(world))
            assert sorted(r for g in grid.dp_groups for r in g) == list(range(world))
            for d, group in enumerate(grid.pp_groups):
                assert [grid.coords(r) for r in group] == [(p, d) for p in range(pp)]


def test_cluster_and_spread_layouts():
    cluster = make_grid(8, 2, "cluster")
    assert cluster.pp_groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert cluster.dp_groups == [[0, 2, 4, 6], [1, 3, 5, 7]]
    spread = make_grid(8, 2, "spread")
    assert spread.pp_groups == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert spread.dp_groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert "pp_rank 1: 1 3 5 7" in str(cluster)


def test_bad_grids():
    with pytest.raises(ConfigError, match="must divide the world size 6"):
        make_grid(6, 4)
    with pytest.raises(ValueError, match="outside"):
        make_grid(4, 2).coords(4)
    with pytest.raises(ValueError, match="outside"):
        make_grid(4, 2).rank_of(2, 0)


@pytest.mark.parametrize("placement", ["cluster", "spread"])
def test_the_tp_axis_is_innermost_and_the_grid_stays_a_bijection(placement):
    for world, pp, tp in [(8, 2, 2), (12, 3, 2), (16, 2, 4), (6, 1, 3), (4, 2, 1)]:
        grid = make_grid(world, pp, placement, tp_size=tp)
        assert grid.dp_size * pp * tp == world
        coords = [grid.coordinates(r) for r in range(world)]
        assert len(set(coords)) == world
        assert all(grid.rank_of(*c) == r for r, c in enumerate(coords))
        for group in grid.tp_groups:  # consecutive ranks: one host
            assert group == list(range(group[0], group[0] + tp))
        mesh = grid.mesh()
        assert (len(mesh), len(mesh[0]), len(mesh[0][0]), len(mesh[0][0][0])) == (
            pp,
            grid.dp_size,
            1,
            tp,
        )
        assert all(
            mesh[p][d][0][t] == grid.rank_of(p, d, t)
            for p in range(pp)
            for d in range(grid.dp_size)
            for t in range(tp)
        )
    assert make_grid(8, 2, tp_size=2).pp_groups == [[0, 2], [1, 3], [4, 6], [5, 7]]
    with pytest.raises(ConfigError, match="tensor parallel degree 3 must divide the world size 8"):
        make_grid(8, 2, tp_size=3)
    with pytest.raises(ConfigError, match="pipeline degree 4 must divide .* / tensor parallel"):
        make_grid(8, 4, tp_size=4)


PERMUTATIONS = ["DPT", "DTP", "PDT", "PTD", "TDP", "TPD"]


@pytest.mark.parametrize("placement", [*PERMUTATIONS, "cluster", "spread"])
def test_every_placement_is_a_grid(placement):
    """Groups of each axis partition the world; each rank's coordinates are its
    position in its groups; the innermost axis of the placement takes consecutive ranks."""
    for world, pp, tp in [(8, 2, 2), (24, 2, 3), (12, 3, 2), (4, 1, 2), (6, 3, 1)]:
        grid = make_grid(world, pp, placement, tp_size=tp)
        dp = grid.dp_size
        assert dp * pp * tp == world
        coords = [grid.coordinates(r) for r in range(world)]
        assert sorted(c[:3] for c in coords) == [
            (p, d, t) for p in range(pp) for d in range(dp) for t in range(tp)
        ]
        assert all(grid.rank_of(*c) == r for r, c in enumerate(coords))
        for groups, axis in ((grid.pp_groups, 0), (grid.dp_groups, 1), (grid.tp_groups, 2)):
            assert sorted(r for g in groups for r in g) == list(range(world))
            for group in groups:  # one group: the other coordinates fixed, this one 0..n-1
                seen = [grid.coordinates(r) for r in group]
                assert [c[axis] for c in seen] == list(range(len(group)))
                assert len({c[:axis] + c[axis + 1 :] for c in seen}) == 1
        mesh = grid.mesh()
        assert all(
            mesh[p][d][0][t] == grid.rank_of(p, d, t)
            for p in range(pp)
            for d in range(dp)
            for t in range(tp)
        )
        inner = {"P": grid.pp_groups, "D": grid.dp_groups, "T": grid.tp_groups}[grid.order[-1]]
        for group in inner:
            assert group == list(range(group[0], group[0] + len(group)))


def test_named_placements_are_permutations():
    for world, pp, tp in [(8, 2, 2), (16, 2, 2), (12, 2, 3)]:
        for name, letters in (("cluster", "DPT"), ("spread", "PDT")):
            named, spelled = make_grid(world, pp, name, tp), make_grid(world, pp, letters, tp)
            assert named.order == letters.replace("T", "CT")
            assert [named.coordinates(r) for r in range(world)] == [
                spelled.coordinates(r) for r in range(world)
            ]


def test_smp_tables():
    """SageMaker model parallelism's examples: 8 ranks, tp 2, pp 2, dp 2."""
    dpt = make_grid(8, 2, "DPT", tp_size=2)
    assert [dpt.coordinates(r)[:3] for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1), (0, 1, 0), (0, 1, 1), (1, 1, 0), (1, 1, 1)
    ]  # fmt: skip
    ptd = make_grid(8, 2, "PTD", tp_size=2)
    assert [ptd.coordinates(r)[:3] for r in range(8)] == [
        (0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1), (1, 0, 0), (1, 1, 0), (1, 0, 1), (1, 1, 1)
    ]  # fmt: skip
    tpd = make_grid(4, 2, "TPD", tp_size=2)  # pp 2 x tp 2: the TP groups far apart
    assert tpd.tp_groups == [[0, 2], [1, 3]] and tpd.pp_groups == [[0, 1], [2, 3]]
    assert "grid 2 (pp) x 1 (dp) x 2 (tp), TPD" in str(tpd)
    assert "pp_rank 1: 1,3" in str(tpd)
    assert "cluster (DPCT)" in str(make_grid(4, 2))


@pytest.mark.parametrize("bad", ["DP", "DPTT", "dpt", "XYZ", "", "clustered", 3, None])
def test_bad_placements_name_the_accepted_forms(bad):
    from mpar.config import config_from_dict

    with pytest.raises(ConfigError, match="'cluster', 'spread', or a permutation of the letters"):
        make_grid(4, 2, bad)
    with pytest.raises(ConfigError, match="placement_strategy"):
        config_from_dict({"placement_strategy": bad})


@pytest.mark.parametrize("placement", ["cluster", "spread", "CDPT", "TCPD", "DPT", "TPD"])
def test_the_cp_axis_is_a_fourth_axis(placement):
    """Groups along cp (and dp x cp) partition the world; cp sits right outside tp in the
    named placements and where a three-letter placement leaves it out."""
    for world, pp, tp, cp in [(8, 2, 1, 2), (16, 2, 2, 2), (8, 1, 2, 4), (24, 1, 3, 2)]:
        grid = make_grid(world, pp, placement, tp_size=tp, cp_size=cp)
        assert grid.dp_size * pp * tp * cp == world
        coords = [grid.coordinates(r) for r in range(world)]
        assert len(set(coords)) == world
        assert all(grid.rank_of(*c) == r for r, c in enumerate(coords))
        for groups, axis in ((grid.cp_groups, 3), (grid.tp_groups, 2), (grid.dp_groups, 1)):
            assert sorted(r for g in groups for r in g) == list(range(world))
            for group in groups:
                assert [coords[r][axis] for r in group] == list(range(len(group)))
        for group in grid.dp_cp_groups:  # the ranks of one stage and TP piece
            assert len(group) == grid.dp_size * cp
            assert len({(coords[r].pp, coords[r].tp) for r in group}) == 1
        mesh = grid.mesh()
        assert all(mesh[c.pp][c.dp][c.cp][c.tp] == r for r, c in enumerate(coords))
    if placement in ("cluster", "spread", "DPT"):
        grid = make_grid(16, 2, placement, tp_size=2, cp_size=2)
        assert grid.order.endswith("CT")
        assert grid.cp_groups[0] == [0, 2]  # next to the TP group's two ranks


def test_cp_grid_errors_name_the_degrees():
    with pytest.raises(ConfigError, match="context parallel degree 3 must divide the world size 8"):
        make_grid(8, 1, cp_size=3)
    with pytest.raises(ConfigError, match="pipeline degree 8 .* / context parallel degree 2"):
        make_grid(8, 8, cp_size=2)
    assert "2 (cp)" in str(make_grid(8, 2, cp_size=2))
    with pytest.raises(ConfigError, match="C \\(context parallel\\)"):
        make_grid(4, 2, "DPCC")


def test_expert_groups_stay_inside_their_context_parallel_coordinate() -> None:
    # ep 1 with cp 2: every rank's edp group (its dp group) holds the rank itself
    grid = make_grid(8, 1, "cluster", 1, cp_size=2)
    for rank in range(8):
        assert rank in grid.edp_group(rank)
        assert grid.edp_group(rank) == grid.dp_group(0, 0, grid.coordinates(rank).cp)
        assert grid.ep_group(rank) == [rank]
