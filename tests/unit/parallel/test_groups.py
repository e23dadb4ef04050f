"""paddle_dcp.parallel.groups: one group per (members, purpose), made once and kept until
``close``; after it, the next group of that name is a new generation (another store key and
group id, as paddle keeps a group id's context for the life of the process). The group maker
is replaced here by a recorder: making a real gloo group needs the other ranks."""
import pytest

from paddle_dcp.parallel import groups


@pytest.fixture
def made(monkeypatch):
    calls = []

    def make(rank, members, name, gid):
        calls.append((rank, members, name, gid))
        return ("group", name)

    monkeypatch.setattr(groups, "_make_group", make)
    return calls


def test_a_group_is_made_once_per_members_and_purpose(made):
    g = groups.Groups()
    first = g.get(1, (0, 1, 2), "control")
    assert g.get(1, (0, 1, 2), "control") is first
    g.get(1, (0, 1, 2), "background")
    g.get(1, (1, 3), "control")
    assert [name for _, _, name, _ in made] == ["0-1-2/control/0", "0-1-2/background/0", "1-3/control/0"]
    assert len(g) == 3 and g.names() == ["0-1-2/background", "0-1-2/control", "1-3/control"]


def test_after_close_a_group_of_the_same_name_is_a_new_generation_with_another_id(made):
    g = groups.Groups()
    g.get(0, (0, 1), "control")
    g.close()
    assert len(g) == 0
    g.get(0, (0, 1), "control")
    (_, _, name0, gid0), (_, _, name1, gid1) = made
    assert (name0, name1) == ("0-1/control/0", "0-1/control/1") and gid0 != gid1


def test_group_ids_are_the_same_on_every_rank_and_beyond_paddles_own():
    ids = {groups._group_id(f"0-1/control/{i}") for i in range(200)}
    assert len(ids) == 200  # distinct names, distinct ids (no collision among these)
    assert groups._group_id("0-1/control/0") == groups._group_id("0-1/control/0")
    assert all(groups._GROUP_GID_BASE <= i < groups._GROUP_GID_BASE + groups._GROUP_GID_SPAN for i in ids)


def test_close_without_a_transport_or_groups_is_harmless():
    g = groups.Groups()
    g.close()
    g.close()
    assert len(g) == 0
