//! An op's signature: its name, arguments and results, the schema string torch parses, and what
//! the boxed kernel decodes the stack with.

use std::sync::Mutex;

use super::{Error, Result};

/// Keeps `b` for the rest of the process and returns it: what a registered op's names, argument
/// lists and defaults need (torch keeps the op for the process too). Each block's address stays in
/// a static list, so leak checkers (`make valgrind`) see it as still reachable, not as lost.
pub(crate) fn keep<T: ?Sized>(b: Box<T>) -> &'static T {
    static KEPT: Mutex<Vec<usize>> = Mutex::new(Vec::new());
    let kept: &'static T = Box::leak(b);
    KEPT.lock().unwrap_or_else(|e| e.into_inner()).push((kept as *const T).cast::<u8>() as usize);
    kept
}

/// [`keep`] for a copy of a string.
pub(crate) fn keep_str(s: &str) -> &'static str {
    keep(s.to_owned().into_boxed_str())
}

/// The type of an op's argument or result, as the schema says it and the stack encodes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ArgKind {
    /// `Tensor`: an owning handle.
    Tensor,
    /// `Tensor(a!)`: a tensor the op writes in place (the schema marks it, so torch's
    /// functionalization and version counters see the write). Arguments only.
    TensorMut,
    /// `int`: 64 bits.
    Int,
    /// `float`: an f64.
    Float,
    /// `bool`.
    Bool,
    /// `str`: a `std::string` handle (torch 2.10+). Arguments only.
    Str,
    /// `int[]`: a list handle of 64-bit ints (torch 2.10+). Arguments only.
    IntList,
    /// `float[]`: a list handle of f64s (torch 2.10+). Arguments only.
    FloatList,
    /// `bool[]`: a list handle of bools (torch 2.10+). Arguments only.
    BoolList,
    /// `Tensor?`: a tensor or None (0, or a heap box holding an owning handle, freed by the
    /// kernel). Arguments only; its default can be `None`.
    OptTensor,
    /// `Tensor[]`: a list of tensors (a `StableListHandle` of owning handles, torch 2.10+; the
    /// kernel frees the list and owns the handles). Arguments only.
    TensorList,
}

impl ArgKind {
    fn schema_type(self) -> &'static str {
        match self {
            Self::Tensor | Self::TensorMut => "Tensor",
            Self::Int => "int",
            Self::Float => "float",
            Self::Bool => "bool",
            Self::Str => "str",
            Self::IntList => "int[]",
            Self::FloatList => "float[]",
            Self::BoolList => "bool[]",
            Self::OptTensor => "Tensor?",
            Self::TensorList => "Tensor[]",
        }
    }
}

/// An op's name, arguments and results: its schema ([`OpSignature::schema`]), and what
/// [`run_boxed`](super::run_boxed) decodes the stack with, so the two agree by construction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpSignature {
    name: &'static str,
    args: &'static [(&'static str, ArgKind)],
    rets: &'static [ArgKind],
    defaults: &'static [(&'static str, &'static str)],
    /// `args` counted by kind, once (a kernel reads them on every call).
    counts: ArgCounts,
}

/// How many of an op's arguments are of each kind, as a call frame sees them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ArgCounts {
    /// `Tensor` and `Tensor(a!)` arguments.
    pub(crate) tensors: usize,
    /// `Tensor(a!)` arguments.
    pub(crate) mutated: usize,
    /// `Tensor?` and `Tensor[]` arguments (their operands depend on the call).
    pub(crate) counted: usize,
    /// Every other argument, plus one (its count) per `Tensor?` or `Tensor[]` argument.
    pub(crate) scalars: usize,
}

impl ArgCounts {
    const fn of(args: &[(&str, ArgKind)]) -> Self {
        let mut c = Self { tensors: 0, mutated: 0, counted: 0, scalars: 0 };
        let mut i = 0;
        while i < args.len() {
            match args[i].1 {
                ArgKind::Tensor => c.tensors += 1,
                ArgKind::TensorMut => {
                    c.tensors += 1;
                    c.mutated += 1;
                }
                ArgKind::OptTensor | ArgKind::TensorList => {
                    c.counted += 1;
                    c.scalars += 1;
                }
                _ => c.scalars += 1,
            }
            i += 1;
        }
        c
    }
}

impl OpSignature {
    /// Op `name` taking `args` (name, kind) and returning `rets`.
    pub const fn new(
        name: &'static str,
        args: &'static [(&'static str, ArgKind)],
        rets: &'static [ArgKind],
    ) -> Self {
        Self { name, args, rets, defaults: &[], counts: ArgCounts::of(args) }
    }

    /// The same op whose scalar arguments named in `defaults` may be left out: (argument name,
    /// the value as the schema writes it: `1e-05`, `-3`, `True`). [`schema`](Self::schema)
    /// checks each against its argument's kind.
    pub const fn with_defaults(self, defaults: &'static [(&'static str, &'static str)]) -> Self {
        Self { defaults, ..self }
    }

    /// [`with_defaults`](Self::with_defaults) for defaults known at run time (leaked once per
    /// op, as [`leak`](Self::leak) leaks the names).
    pub fn leak_defaults(self, defaults: &[(&str, &str)]) -> Self {
        let defaults: Vec<(&'static str, &'static str)> =
            defaults.iter().map(|&(n, v)| (keep_str(n), keep_str(v))).collect();
        Self { defaults: keep(defaults.into_boxed_slice()), ..self }
    }

    /// An op signature made at run time (e.g. from a kernel's declaration when a module
    /// initialises): the name and argument names are leaked, once per op, for the process (as
    /// the op they define lives that long).
    pub fn leak(name: &str, args: &[(&str, ArgKind)], rets: &[ArgKind]) -> Self {
        let args: Vec<(&'static str, ArgKind)> = args.iter().map(|&(n, k)| (keep_str(n), k)).collect();
        Self::new(keep_str(name), keep(args.into_boxed_slice()), keep(rets.to_vec().into_boxed_slice()))
    }

    /// The op's name (without namespace).
    pub const fn name(&self) -> &'static str {
        self.name
    }

    /// The arguments.
    pub const fn args(&self) -> &'static [(&'static str, ArgKind)] {
        self.args
    }

    /// The results.
    pub const fn rets(&self) -> &'static [ArgKind] {
        self.rets
    }

    /// The arguments counted by kind.
    pub(crate) const fn arg_counts(&self) -> ArgCounts {
        self.counts
    }

    /// The scalar arguments' defaults (argument name, schema text).
    pub const fn defaults(&self) -> &'static [(&'static str, &'static str)] {
        self.defaults
    }

    /// The schema string torch parses: `name(Tensor x, Tensor(a!) y, float a=0.5) -> Tensor`
    /// (mutated tensors get alias sets `a`, `b`, ... in order; no results is `-> ()`, several a
    /// tuple). [`Error::Invalid`] for a result of kind `TensorMut`, `Str` or a list, more than 26
    /// mutated tensors, a name that is not an identifier, or a default that names no argument or
    /// is not a value of its argument's kind (an `int`, a finite `float`, `True`/`False`, a
    /// double-quoted string literal, a list `[v, ...]` of its element kind, `None` for a
    /// `Tensor?`; none for any other tensor).
    pub fn schema(&self) -> Result<String> {
        let ident = |what: &str, s: &str| {
            let ok = s.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if ok { Ok(()) } else { Err(Error::Invalid(format!("{what}: {s:?} is not an identifier"))) }
        };
        ident("op name", self.name)?;
        for &(name, value) in self.defaults {
            let Some(&(_, kind)) = self.args.iter().find(|(n, _)| *n == name) else {
                return Err(Error::Invalid(format!(
                    "{}: default {name}={value}: no such argument",
                    self.name
                )));
            };
            let int = |v: &str| v.parse::<i64>().is_ok();
            let float = |v: &str| v.parse::<f64>().is_ok_and(f64::is_finite);
            let boolean = |v: &str| matches!(v, "True" | "False");
            let ok = match kind {
                ArgKind::Int => int(value),
                ArgKind::Float => float(value),
                ArgKind::Bool => boolean(value),
                ArgKind::Str => is_string_literal(value),
                ArgKind::IntList => is_list_of(value, int),
                ArgKind::FloatList => is_list_of(value, float),
                ArgKind::BoolList => is_list_of(value, boolean),
                ArgKind::OptTensor => value == "None",
                ArgKind::Tensor | ArgKind::TensorMut | ArgKind::TensorList => false,
            };
            if !ok {
                return Err(Error::Invalid(format!(
                    "{}: default {name}={value:?} is not a value of {}'s kind {kind:?}",
                    self.name, name
                )));
            }
        }
        let mut alias = b'a';
        let mut args = Vec::with_capacity(self.args.len());
        for &(name, kind) in self.args {
            ident("argument name", name)?;
            if kind == ArgKind::TensorMut {
                if alias > b'z' {
                    return Err(Error::Invalid(format!("{}: more than 26 mutated tensors", self.name)));
                }
                args.push(format!("Tensor({}!) {name}", alias as char));
                alias += 1;
            } else {
                match self.defaults.iter().find(|(n, _)| *n == name) {
                    Some((_, value)) => args.push(format!("{} {name}={value}", kind.schema_type())),
                    None => args.push(format!("{} {name}", kind.schema_type())),
                }
            }
        }
        if let Some(k) = self.rets.iter().find(|k| {
            matches!(
                k,
                ArgKind::TensorMut
                    | ArgKind::Str
                    | ArgKind::IntList
                    | ArgKind::FloatList
                    | ArgKind::BoolList
                    | ArgKind::OptTensor
                    | ArgKind::TensorList
            )
        }) {
            return Err(Error::Invalid(format!(
                "{}: a result of kind {k:?} (Tensor, int, float, bool only)",
                self.name
            )));
        }
        let rets: Vec<&str> = self.rets.iter().map(|k| k.schema_type()).collect();
        let rets = match rets.len() {
            1 => rets[0].to_owned(),
            _ => format!("({})", rets.join(", ")),
        };
        Ok(format!("{}({}) -> {rets}", self.name, args.join(", ")))
    }
}

/// `s` as a schema string literal: in double quotes, `\\` and `"` escaped. `None` for a string
/// with a control character (torch's schema lexer has no escape this module writes for them).
pub(crate) fn string_literal(s: &str) -> Option<String> {
    if s.chars().any(char::is_control) {
        return None;
    }
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        if c == '\\' || c == '"' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    Some(out)
}

/// Whether `v` is a literal [`string_literal`] writes.
fn is_string_literal(v: &str) -> bool {
    let Some(inner) = v.strip_prefix('"').and_then(|v| v.strip_suffix('"')) else { return false };
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' if !matches!(chars.next(), Some('\\' | '"')) => return false,
            '\\' => {}
            '"' => return false,
            c if c.is_control() => return false,
            _ => {}
        }
    }
    true
}

/// Whether `v` is `[a, b, ...]` (or `[]`), each element passing `element`.
fn is_list_of(v: &str, element: impl Fn(&str) -> bool) -> bool {
    let Some(inner) = v.strip_prefix('[').and_then(|v| v.strip_suffix(']')) else { return false };
    inner.trim().is_empty() || inner.split(',').all(|e| element(e.trim()))
}
