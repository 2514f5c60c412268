//! Several results ([`ResultDef`]): each result's shape and dtype rule, the attributes a rule
//! reads ([`Attrs`]), and the rules resolved against a function's parameters ([`resolve`]) and run
//! ([`result_shapes`]): what `add_kernel`'s Python rule (`kernel.rs`) and the native op's output
//! rule (`native.rs`) share.

use crate::DataType;

/// An attribute's value, as a result's shape rule reads it (borrowed from the call being traced
/// or run).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AttrValue<'a> {
    /// A `float32` or `float64` attribute.
    Float(f64),
    /// An `int32` or `int64` attribute.
    Int(i64),
    /// A `bool` attribute.
    Bool(bool),
    /// A `str` attribute.
    Str(&'a str),
    /// An `int32[]` or `int64[]` attribute.
    Ints(&'a [i64]),
    /// A `float32[]` or `float64[]` attribute.
    Floats(&'a [f64]),
    /// A `bool[]` attribute.
    Bools(&'a [bool]),
}

/// The kernel's attributes by name, as a [`ShapeFn`] reads them (the values of the call being
/// traced or run).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Attrs<'a> {
    values: Vec<(&'a str, AttrValue<'a>)>,
}

impl<'a> Attrs<'a> {
    /// No attributes.
    pub fn new() -> Self {
        Self::default()
    }

    /// No attributes, room for `n`.
    pub fn with_capacity(n: usize) -> Self {
        Self { values: Vec::with_capacity(n) }
    }

    /// Adds attribute `name` (a later value of the same name replaces it).
    pub fn insert(&mut self, name: &'a str, value: AttrValue<'a>) {
        match self.values.iter_mut().find(|(n, _)| *n == name) {
            Some(slot) => slot.1 = value,
            None => self.values.push((name, value)),
        }
    }

    /// Attribute `name`, if the kernel has it.
    pub fn get(&self, name: &str) -> Option<AttrValue<'a>> {
        self.values.iter().find(|(n, _)| *n == name).map(|&(_, v)| v)
    }

    fn missing(name: &str, want: &str) -> String {
        format!("attribute {name}: no {want} attribute of that name")
    }

    /// A float attribute (an int one converted).
    pub fn f64(&self, name: &str) -> Result<f64, String> {
        match self.get(name) {
            Some(AttrValue::Float(v)) => Ok(v),
            Some(AttrValue::Int(v)) => Ok(v as f64),
            _ => Err(Self::missing(name, "float")),
        }
    }

    /// An int attribute.
    pub fn i64(&self, name: &str) -> Result<i64, String> {
        match self.get(name) {
            Some(AttrValue::Int(v)) => Ok(v),
            _ => Err(Self::missing(name, "int")),
        }
    }

    /// A bool attribute.
    pub fn bool(&self, name: &str) -> Result<bool, String> {
        match self.get(name) {
            Some(AttrValue::Bool(v)) => Ok(v),
            _ => Err(Self::missing(name, "bool")),
        }
    }

    /// A `str` attribute.
    pub fn str(&self, name: &str) -> Result<&'a str, String> {
        match self.get(name) {
            Some(AttrValue::Str(v)) => Ok(v),
            _ => Err(Self::missing(name, "str")),
        }
    }

    /// An `int32[]` or `int64[]` attribute (e.g. a reduction's axes).
    pub fn i64s(&self, name: &str) -> Result<&'a [i64], String> {
        match self.get(name) {
            Some(AttrValue::Ints(v)) => Ok(v),
            _ => Err(Self::missing(name, "int array")),
        }
    }

    /// A `float32[]` or `float64[]` attribute.
    pub fn f64s(&self, name: &str) -> Result<&'a [f64], String> {
        match self.get(name) {
            Some(AttrValue::Floats(v)) => Ok(v),
            _ => Err(Self::missing(name, "float array")),
        }
    }

    /// A `bool[]` attribute.
    pub fn bools(&self, name: &str) -> Result<&'a [bool], String> {
        match self.get(name) {
            Some(AttrValue::Bools(v)) => Ok(v),
            _ => Err(Self::missing(name, "bool array")),
        }
    }
}

/// What an attribute's declared type (`KernelDef.attrs`) gives a rule: the [`AttrValue`] variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum AttrKind {
    Float,
    Int,
    Bool,
    Str,
    Ints,
    Floats,
    Bools,
}

impl AttrKind {
    /// The kind of a declared type name (`"float32"`, `"int64[]"`, `"str"`, ...), `None` for
    /// another.
    pub(super) fn of(name: &str) -> Option<Self> {
        Some(match name {
            "float32" | "float64" => Self::Float,
            "int32" | "int64" => Self::Int,
            "bool" => Self::Bool,
            "str" => Self::Str,
            "int32[]" | "int64[]" => Self::Ints,
            "float32[]" | "float64[]" => Self::Floats,
            "bool[]" => Self::Bools,
            _ => return None,
        })
    }
}

/// An attribute's value owned (read from Python), lent to a rule as an [`AttrValue`].
#[derive(Debug, Clone, PartialEq)]
pub(super) enum OwnedAttr {
    Float(f64),
    Int(i64),
    Bool(bool),
    Str(String),
    Ints(Vec<i64>),
    Floats(Vec<f64>),
    Bools(Vec<bool>),
}

impl OwnedAttr {
    /// The value as a rule reads it.
    pub(super) fn value(&self) -> AttrValue<'_> {
        match self {
            Self::Float(v) => AttrValue::Float(*v),
            Self::Int(v) => AttrValue::Int(*v),
            Self::Bool(v) => AttrValue::Bool(*v),
            Self::Str(v) => AttrValue::Str(v),
            Self::Ints(v) => AttrValue::Ints(v),
            Self::Floats(v) => AttrValue::Floats(v),
            Self::Bools(v) => AttrValue::Bools(v),
        }
    }
}

/// A result's shape as a function of the tensor arguments' shapes (in parameter order, the
/// attributes left out) and the attributes; an `Err` names what is wrong (the caller sees it as
/// the kernel's error, under `jax.jit`, `torch.compile` and eagerly alike). Plain Rust, no
/// Python: the native torch op's Meta and CPU kernels call it too. One shape per tensor
/// parameter: a kernel with an optional or a list parameter
/// ([`KernelDef::optional`](super::KernelDef::optional), [`lists`](super::KernelDef::lists))
/// declares its rules as [`ParamShapeFn`]s instead.
pub type ShapeFn = fn(&[&[i64]], &Attrs<'_>) -> Result<Vec<i64>, String>;

/// One tensor parameter's shape as a [`ParamShapeFn`] reads it: a tensor's, an optional tensor's
/// (absent when the caller passed `None`), or each item's of a list of tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamShape<'a> {
    /// A tensor parameter's shape.
    Tensor(&'a [i64]),
    /// An optional tensor parameter's shape; `None` when the caller passed `None`.
    Optional(Option<&'a [i64]>),
    /// A list-of-tensors parameter: each item's shape, in order (empty for an empty list).
    List(&'a [&'a [i64]]),
}

impl<'a> ParamShape<'a> {
    /// The shape of a tensor parameter, or of an optional one that is present (`None` for an
    /// absent optional or a list).
    pub fn tensor(&self) -> Option<&'a [i64]> {
        match *self {
            Self::Tensor(s) | Self::Optional(Some(s)) => Some(s),
            _ => None,
        }
    }

    /// The items' shapes of a list parameter (`None` for another kind).
    pub fn list(&self) -> Option<&'a [&'a [i64]]> {
        match *self {
            Self::List(l) => Some(l),
            _ => None,
        }
    }
}

/// A result's shape as a function of each tensor parameter's shape, one [`ParamShape`] per
/// tensor parameter in parameter order (the attributes left out): an optional parameter's absent
/// when the caller passed `None`, a list parameter's a slice of its items' shapes. Otherwise as
/// [`ShapeFn`] (every mode calls the same rule); for any kernel, and the only rule form of a
/// kernel with optional or list parameters.
pub type ParamShapeFn = fn(&[ParamShape<'_>], &Attrs<'_>) -> Result<Vec<i64>, String>;

/// How a result's shape is found.
#[derive(Debug, Clone, Copy)]
pub enum ResultShape<'a> {
    /// The shape of tensor parameter `name` (not an optional or list one).
    Like(&'a str),
    /// A rule over the arguments' shapes and the attributes (a reduction, a matmul, ...), one
    /// shape per tensor parameter: not for a kernel with optional or list parameters.
    Rule(ShapeFn),
    /// A rule over each tensor parameter's [`ParamShape`] and the attributes: any kernel,
    /// optional and list parameters included.
    ParamRule(ParamShapeFn),
}

/// How a result's dtype is found.
#[derive(Debug, Clone, Copy)]
pub enum ResultDType<'a> {
    /// The dtype of tensor parameter `name` (not an optional or list one).
    Like(&'a str),
    /// Always this dtype.
    Is(DataType),
}

/// One result of a kernel with several ([`KernelDef::results`](super::KernelDef::results)).
#[derive(Debug, Clone, Copy)]
pub struct ResultDef<'a> {
    /// The result's name: what the backward reads it as (and `grad_<name>`, its cotangent).
    /// Letters, digits and underscores; not a parameter's name, nor `out` or `grad`.
    pub name: &'a str,
    /// Its shape.
    pub shape: ResultShape<'a>,
    /// Its dtype.
    pub dtype: ResultDType<'a>,
    /// A residual: computed by the forward, handed to the backward, never returned to the caller.
    pub residual: bool,
}

impl<'a> ResultDef<'a> {
    /// A result of the shape and dtype of tensor parameter `param`.
    pub const fn like(name: &'a str, param: &'a str) -> Self {
        Self { name, shape: ResultShape::Like(param), dtype: ResultDType::Like(param), residual: false }
    }

    /// A result of the shape `shape` computes, its dtype `dtype`.
    pub const fn rule(name: &'a str, shape: ShapeFn, dtype: ResultDType<'a>) -> Self {
        Self { name, shape: ResultShape::Rule(shape), dtype, residual: false }
    }

    /// A result of the shape `shape` computes from each tensor parameter's [`ParamShape`] (an
    /// optional's absent when `None`, a list's one per item), its dtype `dtype`: the rule form of
    /// a kernel with optional or list parameters.
    pub const fn param_rule(name: &'a str, shape: ParamShapeFn, dtype: ResultDType<'a>) -> Self {
        Self { name, shape: ResultShape::ParamRule(shape), dtype, residual: false }
    }

    /// The same result, marked a residual.
    pub const fn residual(self) -> Self {
        Self { residual: true, ..self }
    }
}

/// A result's shape rule resolved (`Like` as the index among the tensor parameters).
#[derive(Debug, Clone, Copy)]
pub(super) enum Shape {
    Like(usize),
    Rule(ShapeFn),
    Params(ParamShapeFn),
}

/// The tensor arguments' shapes as [`result_shape`] reads them: one per tensor parameter
/// (`Plain`, a kernel without optional or list parameters), or each parameter's [`ParamShape`].
#[derive(Debug, Clone, Copy)]
pub(super) enum Shapes<'s, 'a> {
    Plain(&'s [&'a [i64]]),
    Params(&'s [ParamShape<'a>]),
}

/// A result's rule with its parameter names resolved: `Like` as the index among the tensor
/// parameters (owned, so the native op may keep it for the process).
#[derive(Debug, Clone)]
pub(super) struct Resolved {
    pub(super) name: String,
    pub(super) shape: Shape,
    pub(super) dtype: Result<usize, DataType>,
    pub(super) residual: bool,
}

/// `results` with their `Like` names resolved against `params` (the function's parameters)
/// less `attrs`; `counted`, the optional and the list parameters (neither a `Like` rule's nor
/// read by a [`ShapeFn`]); a clear error (the field and the value) for a declaration that
/// cannot hold.
pub(super) fn resolve(
    kernel: &str,
    params: &[String],
    attrs: &[(&str, &str)],
    counted: (&[&str], &[&str]),
    results: &[ResultDef<'_>],
) -> Result<Vec<Resolved>, String> {
    let tensors: Vec<&str> =
        params.iter().map(String::as_str).filter(|p| !attrs.iter().any(|(a, _)| a == p)).collect();
    let kind_of = |p: &str| {
        if counted.0.contains(&p) {
            Some("an optional tensor")
        } else if counted.1.contains(&p) {
            Some("a list of tensors")
        } else {
            None
        }
    };
    let first_counted = tensors.iter().find_map(|&t| kind_of(t).map(|k| (t, k)));
    let bad =
        |i: usize, r: &ResultDef<'_>, m: String| format!("kernel {kernel}: results[{i}] ({}): {m}", r.name);
    let like = |i: usize, r: &ResultDef<'_>, what: &str, p: &str| {
        let k = tensors.iter().position(|t| *t == p).ok_or_else(|| {
            bad(
                i,
                r,
                format!("{what} like {p:?}, which is no tensor parameter (tensors: {})", tensors.join(", ")),
            )
        })?;
        match kind_of(p) {
            Some(kind) => Err(bad(
                i,
                r,
                format!("{what} like {p:?}, which is {kind}: name a tensor parameter, or give a rule"),
            )),
            None => Ok(k),
        }
    };
    let mut out = Vec::with_capacity(results.len());
    for (i, r) in results.iter().enumerate() {
        let ident = r.name.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
            && r.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !ident {
            return Err(bad(
                i,
                r,
                "a result's name is letters, digits and underscores, a letter first".into(),
            ));
        }
        if params.iter().any(|p| p == r.name)
            || matches!(r.name, "out" | "grad")
            || r.name.starts_with("grad_")
        {
            return Err(bad(
                i,
                r,
                "the name is taken (a parameter, out, grad or grad_*): choose another".into(),
            ));
        }
        if results[..i].iter().any(|o| o.name == r.name) {
            return Err(bad(i, r, "a second result of that name".into()));
        }
        let shape = match r.shape {
            ResultShape::Like(p) => Shape::Like(like(i, r, "shape", p)?),
            ResultShape::Rule(f) => match first_counted {
                Some((p, kind)) => {
                    return Err(bad(
                        i,
                        r,
                        format!(
                            "a ShapeFn rule reads one shape per tensor parameter, but {p:?} is {kind}: \
                             declare it ResultDef::param_rule (a ParamShapeFn reads each parameter's ParamShape)"
                        ),
                    ));
                }
                None => Shape::Rule(f),
            },
            ResultShape::ParamRule(f) => Shape::Params(f),
        };
        let dtype = match r.dtype {
            ResultDType::Like(p) => Ok(like(i, r, "dtype", p)?),
            ResultDType::Is(d) => Err(d),
        };
        out.push(Resolved { name: r.name.to_owned(), shape, dtype, residual: r.residual });
    }
    if !out.is_empty() && out.iter().all(|r| r.residual) {
        return Err(format!("kernel {kernel}: results: every result is a residual; the caller needs one"));
    }
    Ok(out)
}

/// Each result's shape (and, `Like`, the tensor index its dtype follows): what jax's `ffi_call`,
/// the fake kernel and the native op's buffers are made from.
pub(super) fn result_shapes(
    kernel: &str,
    results: &[Resolved],
    shapes: Shapes<'_, '_>,
    attrs: &Attrs<'_>,
) -> Result<Vec<Vec<i64>>, String> {
    results.iter().map(|r| result_shape(r, shapes, attrs).map_err(|e| format!("{kernel}: {e}"))).collect()
}

/// An author's shape rule for result `name`, run: its error, or its panic (an index past the
/// shapes it was given, an `unwrap`), as an error naming the result. Every mode calls the rules
/// through here (the native op's kernels, and the Python face jax and torch's fake kernels call,
/// where a panic would otherwise leave as a `PanicException`, which is no `Exception`).
fn run_rule(name: &str, rule: impl FnOnce() -> Result<Vec<i64>, String>) -> Result<Vec<i64>, String> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(rule)) {
        Ok(made) => made.map_err(|e| format!("result {name}: {e}")),
        Err(panic) => {
            let e = format!("result {name}: the shape rule panicked: {}", crate::xla::panic_message(&*panic));
            crate::xla::drop_payload(panic);
            Err(e)
        }
    }
}

/// One result's shape by its rule (see [`result_shapes`]); an error names the result (the caller
/// names the kernel: the native op's errors carry its name already).
pub(super) fn result_shape(
    r: &Resolved,
    shapes: Shapes<'_, '_>,
    attrs: &Attrs<'_>,
) -> Result<Vec<i64>, String> {
    let no_tensor = |k: usize| format!("result {}: no tensor argument {k}", r.name);
    let shape = match (r.shape, shapes) {
        (Shape::Like(k), Shapes::Plain(s)) => s.get(k).ok_or_else(|| no_tensor(k))?.to_vec(),
        (Shape::Like(k), Shapes::Params(s)) => {
            s.get(k).and_then(ParamShape::tensor).ok_or_else(|| no_tensor(k))?.to_vec()
        }
        (Shape::Rule(f), Shapes::Plain(s)) => run_rule(&r.name, || f(s, attrs))?,
        (Shape::Rule(_), Shapes::Params(_)) => {
            // (resolve refuses a ShapeFn for a kernel with optional or list parameters.)
            return Err(format!("result {}: a ShapeFn rule cannot read optional or list parameters", r.name));
        }
        (Shape::Params(f), Shapes::Params(s)) => run_rule(&r.name, || f(s, attrs))?,
        (Shape::Params(f), Shapes::Plain(s)) => {
            let view: Vec<ParamShape<'_>> = s.iter().map(|&t| ParamShape::Tensor(t)).collect();
            run_rule(&r.name, || f(&view, attrs))?
        }
    };
    if let Some(d) = shape.iter().find(|&&d| d < 0) {
        return Err(format!("result {}: the shape rule gave extent {d} in {shape:?}", r.name));
    }
    // XLA aborts the process on an element count past i64 (and no allocation could hold one).
    if shape.iter().try_fold(1i64, |n, &d| n.checked_mul(d)).is_none() {
        return Err(format!(
            "result {}: the shape rule gave {shape:?}, whose element count overflows a 64-bit integer",
            r.name
        ));
    }
    Ok(shape)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(shapes: &[&[i64]], attrs: &Attrs<'_>) -> Result<Vec<i64>, String> {
        let k = attrs.i64("k").unwrap_or(1);
        match shapes.first() {
            Some(&[r, _]) => Ok(vec![r * k]),
            s => Err(format!("x: expected 2 dimensions, got {s:?}")),
        }
    }

    fn params(p: &[&str]) -> Vec<String> {
        p.iter().map(|&p| p.to_owned()).collect()
    }

    fn huge(_: &[&[i64]], _: &Attrs<'_>) -> Result<Vec<i64>, String> {
        Ok(vec![i64::MAX / 2, 4])
    }

    #[test]
    fn a_rule_whose_element_count_overflows_is_refused_naming_the_result() {
        let results = [ResultDef::rule("big", huge, ResultDType::Is(DataType::INT32))];
        let resolved = resolve("k", &params(&["x"]), &[], (&[], &[]), &results).unwrap();
        let e = result_shapes("k", &resolved, Shapes::Plain(&[&[2, 3]]), &Attrs::new()).unwrap_err();
        assert!(e.contains("result big") && e.contains("overflows"), "{e}");
    }

    #[test]
    fn like_names_resolve_to_tensor_positions_and_rules_run() {
        let results = [
            ResultDef::like("y", "w"),
            ResultDef::rule("r", rows, ResultDType::Is(DataType::INT32)).residual(),
        ];
        let r =
            resolve("k", &params(&["x", "eps", "w"]), &[("eps", "float64")], (&[], &[]), &results).unwrap();
        // w is tensor 1 (eps is an attribute).
        assert!(matches!(r[0].shape, Shape::Like(1)));
        assert_eq!(r[0].dtype, Ok(1));
        assert!(r[1].residual && r[1].dtype == Err(DataType::INT32));
        let mut a = Attrs::new();
        a.insert("k", AttrValue::Int(3));
        let shapes = result_shapes("k", &r, Shapes::Plain(&[&[4, 5], &[5]]), &a).unwrap();
        assert_eq!(shapes, vec![vec![5], vec![12]]);
        let e = result_shapes("k", &r, Shapes::Plain(&[&[4, 5, 6], &[5]]), &a).unwrap_err();
        assert_eq!(e, "k: result r: x: expected 2 dimensions, got Some([4, 5, 6])");
    }

    #[test]
    fn a_bad_declaration_names_the_result_and_the_value() {
        let p = params(&["x", "eps"]);
        let attrs = [("eps", "float64")];
        let e = resolve("k", &p, &attrs, (&[], &[]), &[ResultDef::like("y", "eps")]).unwrap_err();
        assert_eq!(
            e,
            "kernel k: results[0] (y): shape like \"eps\", which is no tensor parameter (tensors: x)"
        );
        let e = resolve("k", &p, &attrs, (&[], &[]), &[ResultDef::like("x", "x")]).unwrap_err();
        assert!(e.contains("results[0] (x): the name is taken"), "{e}");
        let e = resolve("k", &p, &attrs, (&[], &[]), &[ResultDef::like("y", "x"), ResultDef::like("y", "x")])
            .unwrap_err();
        assert!(e.contains("results[1] (y): a second result"), "{e}");
        let e = resolve("k", &p, &attrs, (&[], &[]), &[ResultDef::like("9y", "x")]).unwrap_err();
        assert!(e.contains("letters, digits and underscores"), "{e}");
        let e = resolve("k", &p, &attrs, (&[], &[]), &[ResultDef::like("y", "x").residual()]).unwrap_err();
        assert!(e.contains("every result is a residual"), "{e}");
        fn negative(_: &[&[i64]], _: &Attrs<'_>) -> Result<Vec<i64>, String> {
            Ok(vec![-1])
        }
        let r =
            resolve("k", &p, &attrs, (&[], &[]), &[ResultDef::rule("y", negative, ResultDType::Like("x"))])
                .unwrap();
        let e = result_shapes("k", &r, Shapes::Plain(&[&[2]]), &Attrs::new()).unwrap_err();
        assert_eq!(e, "k: result y: the shape rule gave extent -1 in [-1]");
    }

    #[test]
    fn attrs_read_by_type() {
        let mut a = Attrs::new();
        a.insert("f", AttrValue::Float(0.5));
        a.insert("n", AttrValue::Int(2));
        a.insert("b", AttrValue::Bool(true));
        a.insert("n", AttrValue::Int(3));
        assert_eq!((a.f64("f"), a.f64("n"), a.i64("n"), a.bool("b")), (Ok(0.5), Ok(3.0), Ok(3), Ok(true)));
        assert_eq!(a.i64("f").unwrap_err(), "attribute f: no int attribute of that name");
        assert_eq!(a.get("zz"), None);
        let (axes, scale, mask) = (vec![0i64, -1], vec![0.5f64], vec![true]);
        a.insert("mode", AttrValue::Str("sum"));
        a.insert("axes", AttrValue::Ints(&axes));
        a.insert("scale", AttrValue::Floats(&scale));
        a.insert("mask", AttrValue::Bools(&mask));
        assert_eq!(a.str("mode"), Ok("sum"));
        assert_eq!(a.i64s("axes"), Ok(&[0i64, -1][..]));
        assert_eq!(a.f64s("scale"), Ok(&[0.5][..]));
        assert_eq!(a.bools("mask"), Ok(&[true][..]));
        assert_eq!(a.i64s("mode").unwrap_err(), "attribute mode: no int array attribute of that name");
        assert_eq!(a.str("axes").unwrap_err(), "attribute axes: no str attribute of that name");
    }

    /// A rule over each parameter's shape: the bias's (absent when None), every list item's.
    fn stacked(p: &[ParamShape<'_>], _: &Attrs<'_>) -> Result<Vec<i64>, String> {
        let items = p[1].list().ok_or("xs: not a list")?;
        let extra = i64::from(p[2].tensor().is_some());
        Ok(vec![items.len() as i64 + extra, p[0].tensor().ok_or("x: absent")?[0]])
    }

    #[test]
    fn a_param_rule_sees_optionals_as_absent_and_lists_as_lists() {
        let p = params(&["x", "xs", "bias", "eps"]);
        let attrs = [("eps", "float64")];
        let results = [
            ResultDef::param_rule("y", stacked, ResultDType::Like("x")),
            ResultDef::like("r", "x").residual(),
        ];
        let r = resolve("k", &p, &attrs, (&["bias"], &["xs"]), &results).unwrap();
        assert!(r[0].dtype == Ok(0) && matches!(r[1].shape, Shape::Like(0)));
        let items: [&[i64]; 2] = [&[3], &[3]];
        let args = [ParamShape::Tensor(&[3]), ParamShape::List(&items), ParamShape::Optional(None)];
        let shapes = result_shapes("k", &r, Shapes::Params(&args), &Attrs::new()).unwrap();
        assert_eq!(shapes, vec![vec![2, 3], vec![3]]);
        let args = [ParamShape::Tensor(&[3]), ParamShape::List(&[]), ParamShape::Optional(Some(&[3]))];
        let shapes = result_shapes("k", &r, Shapes::Params(&args), &Attrs::new()).unwrap();
        assert_eq!(shapes, vec![vec![1, 3], vec![3]]);
        // The same rule on a kernel without optional or list parameters reads plain shapes.
        fn first(p: &[ParamShape<'_>], _: &Attrs<'_>) -> Result<Vec<i64>, String> {
            Ok(p[0].tensor().unwrap().to_vec())
        }
        let r = resolve(
            "k",
            &params(&["x"]),
            &[],
            (&[], &[]),
            &[ResultDef::param_rule("y", first, ResultDType::Like("x"))],
        )
        .unwrap();
        assert_eq!(
            result_shapes("k", &r, Shapes::Plain(&[&[4, 2]]), &Attrs::new()).unwrap(),
            vec![vec![4, 2]]
        );
    }

    #[test]
    fn a_rule_that_panics_is_an_error_naming_the_result() {
        // A rule reading past the shapes it was given (a safe index: it panics).
        fn past(p: &[ParamShape<'_>], _: &Attrs<'_>) -> Result<Vec<i64>, String> {
            Ok(p[7].tensor().unwrap_or_default().to_vec())
        }
        fn past_plain(s: &[&[i64]], _: &Attrs<'_>) -> Result<Vec<i64>, String> {
            Ok(s[3].to_vec())
        }
        let r = resolve(
            "k",
            &params(&["x", "xs"]),
            &[],
            (&[], &["xs"]),
            &[ResultDef::param_rule("y", past, ResultDType::Is(DataType::FLOAT32))],
        )
        .unwrap();
        let args = [ParamShape::Tensor(&[2]), ParamShape::List(&[])];
        let e = result_shapes("k", &r, Shapes::Params(&args), &Attrs::new()).unwrap_err();
        assert!(e.starts_with("k: result y: the shape rule panicked: index out of bounds"), "{e}");
        let r = resolve(
            "k",
            &params(&["x"]),
            &[],
            (&[], &[]),
            &[ResultDef::rule("z", past_plain, ResultDType::Like("x"))],
        )
        .unwrap();
        let e = result_shapes("k", &r, Shapes::Plain(&[&[2]]), &Attrs::new()).unwrap_err();
        assert!(e.starts_with("k: result z: the shape rule panicked: index out of bounds"), "{e}");
    }

    #[test]
    fn optional_and_list_parameters_refuse_shape_fns_and_like_rules() {
        let p = params(&["x", "xs", "bias"]);
        let counted: (&[&str], &[&str]) = (&["bias"], &["xs"]);
        let e = resolve("k", &p, &[], counted, &[ResultDef::rule("y", rows, ResultDType::Like("x"))])
            .unwrap_err();
        assert!(
            e.starts_with("kernel k: results[0] (y): a ShapeFn rule reads one shape per tensor parameter"),
            "{e}"
        );
        assert!(e.contains("\"xs\" is a list of tensors") && e.contains("ResultDef::param_rule"), "{e}");
        let e = resolve("k", &p, &[], counted, &[ResultDef::like("y", "bias")]).unwrap_err();
        assert_eq!(
            e,
            "kernel k: results[0] (y): shape like \"bias\", which is an optional tensor: name a tensor parameter, or give a rule"
        );
        let e =
            resolve("k", &p, &[], counted, &[ResultDef::param_rule("y", stacked, ResultDType::Like("xs"))])
                .unwrap_err();
        assert!(e.contains("dtype like \"xs\", which is a list of tensors"), "{e}");
    }
}
