//! The sequence numbers of one rank's event stream, judged without I/O: apply, skip a duplicate,
//! recover a gap, or re-sync after the numbering went backwards (a restarted or broken
//! publisher).

/// How far behind the last replayed batch a live batch may be and still count as one the replay
/// already delivered (the SUB buffers live batches while a replay runs).
pub(crate) const REPLAY_OVERLAP: u64 = 4096;

/// What to do with a batch, given the batches seen before.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The next batch (or the first one): apply it.
    Apply,
    /// Already applied (a re-send, or delivered by a replay): skip it.
    Duplicate,
    /// Batches `from..to` are missing; `to` is this batch.
    Gap { from: u64, to: u64 },
    /// The live numbering went backwards: the publisher restarted or is broken. Re-sync.
    Backwards,
}

/// The last batches applied from one rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Sequence {
    /// The highest sequence number applied, live or replayed.
    applied: Option<u64>,
    /// The last sequence number applied from the live stream.
    live: Option<u64>,
}

impl Sequence {
    /// Judges batch `seq` from the live stream.
    pub(crate) fn judge(&self, seq: u64) -> Verdict {
        let Some(applied) = self.applied else {
            return Verdict::Apply;
        };
        if seq > applied {
            return if seq == applied + 1 {
                Verdict::Apply
            } else {
                Verdict::Gap {
                    from: applied + 1,
                    to: seq,
                }
            };
        }
        let replayed = self.live.is_none_or(|l| seq > l) && applied - seq <= REPLAY_OVERLAP;
        if replayed || self.live == Some(seq) {
            Verdict::Duplicate
        } else {
            Verdict::Backwards
        }
    }

    /// Records live batch `seq` as applied.
    pub(crate) fn applied_live(&mut self, seq: u64) {
        self.applied = Some(seq);
        self.live = Some(seq);
    }

    /// Records replayed batches up to `seq` as applied.
    pub(crate) fn applied_replay(&mut self, seq: u64) {
        self.applied = Some(self.applied.map_or(seq, |a| a.max(seq)));
    }

    /// Forgets everything: the next batch is applied whatever its number.
    pub(crate) fn reset(&mut self) {
        *self = Self::default();
    }

    /// The highest sequence number applied.
    pub(crate) fn applied(&self) -> Option<u64> {
        self.applied
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(seqs: &[u64]) -> Sequence {
        let mut s = Sequence::default();
        for q in seqs {
            s.applied_live(*q);
        }
        s
    }

    #[test]
    fn in_order_batches_apply_and_gaps_are_named() {
        assert_eq!(Sequence::default().judge(17), Verdict::Apply);
        let s = live(&[0, 1, 2]);
        assert_eq!(s.judge(3), Verdict::Apply);
        assert_eq!(s.judge(6), Verdict::Gap { from: 3, to: 6 });
        assert_eq!(s.judge(2), Verdict::Duplicate);
    }

    #[test]
    fn a_jump_to_the_top_then_back_is_a_restart_not_a_silent_drop() {
        let mut s = live(&[4]);
        assert_eq!(
            s.judge(u64::MAX),
            Verdict::Gap {
                from: 5,
                to: u64::MAX
            }
        );
        s.applied_live(u64::MAX);
        assert_eq!(s.judge(5), Verdict::Backwards);
        assert_eq!(s.judge(0), Verdict::Backwards);
        s.reset();
        assert_eq!(s.judge(5), Verdict::Apply);
    }

    #[test]
    fn live_batches_a_replay_already_delivered_are_duplicates() {
        let mut s = Sequence::default();
        s.applied_replay(40);
        assert_eq!(s.judge(38), Verdict::Duplicate);
        assert_eq!(s.judge(41), Verdict::Apply);
        s.applied_live(41);
        s.applied_replay(60);
        assert_eq!(s.judge(50), Verdict::Duplicate);
        assert_eq!(s.judge(41), Verdict::Duplicate);
        assert_eq!(s.judge(40), Verdict::Backwards);
    }

    #[test]
    fn a_restart_far_below_a_replay_is_backwards() {
        let mut s = Sequence::default();
        s.applied_replay(REPLAY_OVERLAP + 10);
        assert_eq!(s.judge(3), Verdict::Backwards);
    }
}
