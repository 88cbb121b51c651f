"""The mutual-exclusion checker itself (unit tests, no server): every suite's verdict is only as good as it is."""

from __future__ import annotations

from pathlib import Path

from tests.support.exclusion import Section, Sections, overlaps, read_log


def later(found: list[tuple[Section, Section]]) -> list[str]:
    return [second.who for _, second in found]


def test_a_section_starting_inside_another_overlaps_it() -> None:
    sections = [Section("a", 1.0, 9.0), Section("b", 2.0, 3.0), Section("c", 4.0, 5.0), Section("a", 9.5, 10.0)]
    found = overlaps(sections)
    assert later(found) == ["b", "c"]
    assert [first.who for first, _ in found] == ["a", "a"], "each paired with the section it began inside"


def test_sections_that_touch_do_not_overlap() -> None:
    assert overlaps([Section("a", 1.0, 2.0), Section("b", 2.0, 3.0), Section("c", 3.0, 3.5)]) == []


def test_the_slightest_overlap_counts() -> None:
    assert later(overlaps([Section("a", 1.0, 2.0), Section("b", 1.999999, 3.0)])) == ["b"]


def test_order_of_the_input_does_not_matter() -> None:
    sections = [Section("c", 5.0, 6.0), Section("b", 2.0, 5.5), Section("a", 1.0, 3.0)]
    assert sorted(later(overlaps(sections))) == ["b", "c"]


def test_sections_starting_together_overlap() -> None:
    assert len(overlaps([Section("a", 1.0, 2.0), Section("b", 1.0, 1.5)])) == 1


def test_an_open_section_lasts_until_now() -> None:
    sections = [Section("a", 1.0, None), Section("b", 50.0, 51.0)]
    assert later(overlaps(sections, now=100.0)) == ["b"]
    assert overlaps(sections, now=20.0) == [], "b had not begun yet at that moment"


def test_sections_of_different_locks_never_overlap() -> None:
    sections = [Section("a", 1.0, 9.0, lock="x"), Section("b", 2.0, 3.0, lock="y"), Section("c", 4.0, 5.0, lock="x")]
    assert later(overlaps(sections)) == ["c"]


def test_believed_counts_a_section_only_while_its_holder_believed_it_held_the_lock() -> None:
    # The first holder learned of the loss at 3 (held false) and went on until 10: the
    # second one, entering at 5, ran alongside a former holder, not a second one.
    former = Section("a", 0.0, 10.0, held_at_exit=False, believed_until=3.0)
    assert later(overlaps([former, Section("b", 5.0, 6.0)])) == ["b"], "the sections do overlap"
    assert overlaps([former, Section("b", 5.0, 6.0)], believed=True) == []
    assert later(overlaps([former, Section("b", 2.5, 6.0)], believed=True)) == ["b"], "entered while a believed"
    # Still believing at the end: the whole section counts.
    assert later(overlaps([Section("a", 0.0, 10.0), Section("b", 9.0, 11.0)], believed=True)) == ["b"]
    # Never seen believing: nothing of it counts.
    never = Section("a", 0.0, 10.0, held_at_exit=False)
    assert overlaps([never, Section("b", 0.5, 1.0)], believed=True) == []
    # Nor when it begins inside another's belief: its acquire returned, then its process froze past
    # the lease and learned of the loss before the section began (the nemesis found this one).
    told_first = Section("b", 5.0, 5.1, held_at_exit=False, believed_until=5.0)
    assert overlaps([Section("a", 4.0, 10.0), told_first], believed=True) == []
    assert later(overlaps([Section("a", 4.0, 10.0), told_first])) == ["b"], "the sections do overlap"


def test_a_worker_log_reads_back_as_sections(tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.write_text("1 1.0 9.0\n2 2.0 3.0\n3 4.0 5.0\n1 9.5 10.0\n")
    sections = read_log(log, lock="job")
    assert sections[1] == Section("2", 2.0, 3.0, lock="job")
    assert later(overlaps(sections)) == ["2", "3"]
    recorder = Sections()
    recorder.add_log(log)
    assert later(recorder.overlaps()) == ["2", "3"]


def test_a_lost_lock_ends_its_holders_open_section_at_once() -> None:
    recorder = Sections()
    section = recorder.enter("a")
    recorder.on_lost("a")(None)  # the error is not read
    assert section.exit is not None
    recorder.leave(section)  # leaving later does not move the end
    assert section.exit is not None
    ended = section.exit
    recorder.leave(section)
    assert section.exit == ended
