//! What a byte is for (its [`Category`]) and when it was asked for (its [`Phase`]).

use std::fmt;

/// What an allocation holds. Every allocation has exactly one category at any time; a tensor's
/// storage can be re-tagged (an op output that autograd saves becomes an `Activation`): see
/// `Allocator::set_category`, which records the change as a `Retag` event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Category {
    Parameter,
    Gradient,
    OptimizerState,
    /// Saved for backward.
    Activation,
    /// Op outputs not (yet) saved, intermediate gradients and kernel workspaces.
    Temporary,
    /// Data placed on the device (batches, targets).
    Input,
    /// Buffers that cross between ranks (gradient buckets of data-parallel training, activations
    /// sent between pipeline stages).
    Communication,
    Other,
}

impl Category {
    pub const COUNT: usize = 8;
    pub const ALL: [Category; Category::COUNT] = [
        Category::Parameter,
        Category::Gradient,
        Category::OptimizerState,
        Category::Activation,
        Category::Temporary,
        Category::Input,
        Category::Communication,
        Category::Other,
    ];

    /// Stable snake_case name used in reports and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Category::Parameter => "parameter",
            Category::Gradient => "gradient",
            Category::OptimizerState => "optimizer_state",
            Category::Activation => "activation",
            Category::Temporary => "temporary",
            Category::Input => "input",
            Category::Communication => "communication",
            Category::Other => "other",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Category {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The part of a training step that asked for memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    Setup,
    Data,
    Forward,
    Backward,
    Optimizer,
    Eval,
    /// A pass rehearsed before it runs (the optimizer step inside backward's proof that it needs no
    /// new memory: Note [Step in backward] in the train crate): allocated, not computed.
    Rehearsal,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Setup => "setup",
            Phase::Data => "data",
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer",
            Phase::Eval => "eval",
            Phase::Rehearsal => "rehearsal",
        }
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn categories_have_stable_names_and_indexes() {
        let names =
            ["parameter", "gradient", "optimizer_state", "activation", "temporary", "input", "communication", "other"];
        assert_eq!(Category::ALL.len(), names.len());
        for (i, (category, name)) in Category::ALL.iter().zip(names).enumerate() {
            assert_eq!(category.index(), i);
            assert_eq!(category.name(), name);
            assert_eq!(category.to_string(), name);
        }
    }

    #[test]
    fn phases_have_stable_names() {
        let phases = [
            (Phase::Setup, "setup"),
            (Phase::Data, "data"),
            (Phase::Forward, "forward"),
            (Phase::Backward, "backward"),
            (Phase::Optimizer, "optimizer"),
            (Phase::Eval, "eval"),
            (Phase::Rehearsal, "rehearsal"),
        ];
        for (phase, name) in phases {
            assert_eq!(phase.name(), name);
            assert_eq!(phase.to_string(), name);
        }
    }
}
