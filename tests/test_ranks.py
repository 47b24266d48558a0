"""Rank detection from the environment (DESIGN 12)."""

from __future__ import annotations

import pytest

from expr_tracker.ranks import detect


@pytest.mark.parametrize(
    ("env", "rank", "world", "local"),
    [
        ({}, 0, None, 0),  # WORLD_SIZE not set: unknown, not 1 (DESIGN 12)
        ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}, 3, 8, 1),
        ({"LOCAL_RANK": "2"}, 2, None, 2),
        ({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1"}, 5, 16, 1),
        ({"OMPI_COMM_WORLD_RANK": "7", "OMPI_COMM_WORLD_SIZE": "8"}, 7, 8, 0),
        ({"RANK": "1", "SLURM_PROCID": "9", "WORLD_SIZE": "4"}, 1, 4, 0),
        ({"LOCAL_RANK": "1", "SLURM_PROCID": "9"}, 1, None, 1),
    ],
)
def test_detect(env, rank, world, local):
    info = detect(env)
    assert (info.rank, info.world_size, info.local_rank) == (rank, world, local)


def test_garbage_rank_names_the_variable():
    with pytest.raises(ValueError, match="RANK='x'"):
        detect({"RANK": "x"})


def test_a_world_size_that_contradicts_the_rank_is_unknown():
    assert detect({"RANK": "4", "WORLD_SIZE": "4"}).world_size is None
