"""ReadDelay: how late a scheduler's messages are read, whatever the offset between its clock and this one."""

from services.gateway.read_delay import DRIFT, ReadDelay

OFFSET_S = 3.0  # the scheduler's clock is this far behind the gateway's


def _made_at(scheduler_time: float) -> int:
    return round(scheduler_time * 1e6)


def test_a_late_message_is_late_by_its_wait_beyond_the_least_delay():
    delay = ReadDelay()
    for t in (100.0, 100.01, 100.02):  # read 1 ms after they were made, by the scheduler's clock
        assert delay.behind(_made_at(t - OFFSET_S), t + 0.001) < 1e-5
    late = delay.behind(_made_at(100.03 - OFFSET_S), 100.03 + 0.041)  # waited 40 ms more
    assert abs(late - (0.040 - 0.05 * DRIFT)) < 1e-5  # less what the least crept up since the last read
    assert delay.behind(0, 100.1) == 0.0  # not stamped (a detokenizer rebuilt it): never late


def test_a_clock_that_steps_back_is_learnt_again():
    delay = ReadDelay()
    delay.behind(_made_at(100.0 - OFFSET_S), 100.0)
    # The scheduler's clock steps 10 ms back (NTP): its messages look 10 ms late, until the least catches up.
    late = [delay.behind(_made_at(t - OFFSET_S - 0.01), t) for t in (100.1, 101.1, 102.1)]
    assert abs(late[0] - (0.01 - 0.1 * DRIFT)) < 1e-5
    assert late[-1] < 1e-5
