//! `tojson` as Hugging Face chat templates expect it: Python's
//! `json.dumps(x, ensure_ascii=False, indent=indent, sort_keys=sort_keys)`.
//!
//! minijinja's own `tojson` writes compact JSON and escapes HTML characters; a template that
//! puts tool schemas in the prompt would then produce different tokens than the engine
//! (vLLM, SGLang render with Python Jinja), and prefix-cache routing would see a different
//! prompt than the worker caches. Key order is the input's (minijinja `preserve_order`).

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// The `tojson` filter: `x | tojson`, `x | tojson(indent=2)`, `tojson(sort_keys=true)`.
pub(crate) fn tojson_filter(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let options = Options {
        indent,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    let mut out = String::new();
    write_value(&mut out, value, &options, 0)?;
    // Already JSON: the template must not HTML-escape it again.
    Ok(Value::from_safe_string(out))
}

struct Options {
    indent: Option<usize>,
    sort_keys: bool,
    ensure_ascii: bool,
}

fn write_value(
    out: &mut String,
    value: &Value,
    options: &Options,
    depth: usize,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, value)?,
        ValueKind::String => write_string(
            out,
            value.as_str().unwrap_or_default(),
            options.ensure_ascii,
        ),
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if options.sort_keys {
                keys.sort();
            }
            let mut entries = Vec::with_capacity(keys.len());
            for key in keys {
                let item = value.get_item(&key)?;
                entries.push((key, item));
            }
            write_container(out, '{', '}', entries.len(), options, depth, |out, i| {
                let (key, item) = &entries[i];
                let key_text = match key.as_str() {
                    Some(text) => text.to_owned(),
                    None => key.to_string(),
                };
                write_string(out, &key_text, options.ensure_ascii);
                out.push_str(": ");
                write_value(out, item, options, depth + 1)
            })?;
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_container(out, '[', ']', items.len(), options, depth, |out, i| {
                write_value(out, &items[i], options, depth + 1)
            })?;
        }
        ValueKind::Bytes | ValueKind::Plain | ValueKind::Invalid => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson cannot serialize a value of type {}", value.kind()),
            ));
        }
        // ValueKind is non-exhaustive.
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson cannot serialize a value of type {}", value.kind()),
            ));
        }
    }
    Ok(())
}

/// Python's layout: `", "` and `": "` without indent; newline plus indent and `","` with it.
fn write_container(
    out: &mut String,
    open: char,
    close: char,
    len: usize,
    options: &Options,
    depth: usize,
    mut write_item: impl FnMut(&mut String, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if len == 0 {
        out.push(close);
        return Ok(());
    }
    for i in 0..len {
        match options.indent {
            Some(indent) => {
                if i > 0 {
                    out.push(',');
                }
                out.push('\n');
                out.extend(std::iter::repeat_n(' ', indent * (depth + 1)));
            }
            None if i > 0 => out.push_str(", "),
            None => {}
        }
        write_item(out, i)?;
    }
    if let Some(indent) = options.indent {
        out.push('\n');
        out.extend(std::iter::repeat_n(' ', indent * depth));
    }
    out.push(close);
    Ok(())
}

fn write_number(out: &mut String, value: &Value) -> Result<(), Error> {
    if value.is_integer() {
        out.push_str(&value.to_string());
        return Ok(());
    }
    let float = f64::try_from(value.clone())?;
    out.push_str(&python_float_repr(float));
    Ok(())
}

/// `repr(float)` as Python prints it: shortest round-trip digits, `.0` on whole numbers,
/// exponent form below 1e-4 and from 1e16, `NaN`/`Infinity` as `json.dumps` writes them.
fn python_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".to_owned();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.to_owned();
    }
    let abs = x.abs();
    if abs != 0.0 && !(1e-4..1e16).contains(&abs) {
        // Rust writes `1e20` / `1.5e-5`; Python writes `1e+20` / `1.5e-05`.
        let rust = format!("{x:e}");
        let (mantissa, exponent) = rust.split_once('e').unwrap_or((&rust, "0"));
        let (sign, digits) = match exponent.strip_prefix('-') {
            Some(digits) => ('-', digits),
            None => ('+', exponent),
        };
        return format!("{mantissa}e{sign}{digits:0>2}");
    }
    let text = x.to_string();
    if text.contains('.') {
        text
    } else {
        format!("{text}.0")
    }
}

fn write_string(out: &mut String, text: &str, ensure_ascii: bool) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !c.is_ascii()) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(template: &str, ctx: Value) -> String {
        let mut env = minijinja::Environment::new();
        env.add_filter("tojson", tojson_filter);
        env.render_str(template, ctx)
            .unwrap_or_else(|e| panic!("{e:#}"))
    }

    #[test]
    fn matches_python_json_dumps() {
        let ctx = Value::from(minijinja::value::Serde(serde_json::json!({
            "x": {"name": "get_weather", "b": [1, 2.5, true, null], "a": "é \"q\" <&>\n\u{1}"}
        })));
        // python3 -c 'import json; print(json.dumps({"name": "get_weather", "b": [1, 2.5, True, None], "a": "é \"q\" <&>\n\x01"}, ensure_ascii=False))'
        assert_eq!(
            render("{{ x | tojson }}", ctx.clone()),
            r#"{"name": "get_weather", "b": [1, 2.5, true, null], "a": "é \"q\" <&>\n\u0001"}"#
        );
        assert_eq!(
            render("{{ x.b | tojson(indent=2) }}", ctx.clone()),
            "[\n  1,\n  2.5,\n  true,\n  null\n]"
        );
        assert_eq!(
            render("{{ x | tojson(sort_keys=true) }}", ctx),
            r#"{"a": "é \"q\" <&>\n\u0001", "b": [1, 2.5, true, null], "name": "get_weather"}"#
        );
    }

    #[test]
    fn floats_print_like_python() {
        assert_eq!(python_float_repr(1.0), "1.0");
        assert_eq!(python_float_repr(0.1), "0.1");
        assert_eq!(python_float_repr(1e20), "1e+20");
        assert_eq!(python_float_repr(1.5e-5), "1.5e-05");
        assert_eq!(python_float_repr(-2.25), "-2.25");
    }
}
