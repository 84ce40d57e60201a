//! The admin-token check the gateway's and the planner's admin APIs share.
//!
//! It lives here because the token is a setting both roles' configurations carry
//! (`admin_token`), and this is the one crate both already depend on that is not about the
//! domain; it takes the header as text so the crate stays free of HTTP types.

/// Whether a request with this `Authorization` header value may use an admin API guarded by
/// `token`. With no token configured every request may; otherwise the header must be
/// `Bearer <token>` (surrounding white space in the token part ignored).
pub fn admin_authorized(token: Option<&str>, authorization: Option<&str>) -> bool {
    let Some(token) = token else {
        return true;
    };
    let given = authorization
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    same(given.trim().as_bytes(), token.as_bytes())
}

/// Constant-time comparison, so the token cannot be guessed byte by byte from timings.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: Option<&str> = Some("s3cret");

    #[test]
    fn the_right_token_passes() {
        assert!(admin_authorized(TOKEN, Some("Bearer s3cret")));
        assert!(admin_authorized(TOKEN, Some("Bearer  s3cret ")));
    }

    #[test]
    fn a_wrong_token_is_refused() {
        assert!(!admin_authorized(TOKEN, Some("Bearer s3cres")));
        assert!(!admin_authorized(TOKEN, Some("Bearer s3cret2")));
        assert!(!admin_authorized(TOKEN, Some("Bearer ")));
    }

    #[test]
    fn a_missing_header_is_refused() {
        assert!(!admin_authorized(TOKEN, None));
    }

    #[test]
    fn another_scheme_is_refused() {
        assert!(!admin_authorized(TOKEN, Some("Basic s3cret")));
        assert!(!admin_authorized(TOKEN, Some("bearer s3cret")));
        assert!(!admin_authorized(TOKEN, Some("s3cret")));
    }

    #[test]
    fn without_a_token_everything_passes() {
        assert!(admin_authorized(None, None));
        assert!(admin_authorized(None, Some("Bearer anything")));
        assert!(admin_authorized(None, Some("Basic x")));
    }
}
