//! etcd's own users for one Switchyard cluster (`switchyard etcd-auth`, the chart's Job): a
//! role that may read and write only the cluster's prefix, a user with that role for the
//! members, the `root` user etcd wants before `auth enable`, and authentication turned on.
//!
//! Every step is idempotent, so the Job can run on each install and upgrade: an existing role
//! gets its permission granted again, an existing member user gets the password given now (the
//! Secret is the source of truth), and authentication already on stays on. `root` has no
//! password: with etcd's `--client-cert-auth` it is whoever holds a client certificate whose
//! common name is `root`, which is how this runs again once authentication is on.

use etcd_client::{Client, Permission, UserAddOptions};

use crate::RegistryError;
use crate::etcd::EtcdAuth;
use crate::keys::Keys;

/// What [`set_up_cluster_user`] changed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct AuthSetup {
    /// Users and roles that did not exist (`role:<name>`, `user:<name>`).
    pub created: Vec<String>,
}

/// Makes `user` (password `password`) able to read and write `/switchyard/v1/<cluster>/` and
/// nothing else, makes sure `root` exists, and turns authentication on. `admin` connects as
/// root (a client certificate named `root`) or as anyone while authentication is still off.
pub async fn set_up_cluster_user(
    endpoints: &[String],
    admin: &EtcdAuth,
    cluster: &str,
    user: &str,
    password: &str,
) -> Result<AuthSetup, RegistryError> {
    let keys = Keys::new(cluster)?;
    if user.is_empty() || user == "root" {
        return Err(RegistryError::InvalidUser(user.to_owned()));
    }
    let unavailable =
        |action: &'static str| move |source| RegistryError::Unavailable { action, source };
    let mut client = Client::connect(admin.endpoints(endpoints), Some(admin.options()))
        .await
        .map_err(unavailable("connect"))?;
    let mut setup = AuthSetup::default();

    let roles = client
        .role_list()
        .await
        .map_err(unavailable("list etcd roles"))?;
    if !roles.roles().iter().any(|r| r == user) {
        client
            .role_add(user)
            .await
            .map_err(unavailable("add an etcd role"))?;
        setup.created.push(format!("role:{user}"));
    }
    client
        .role_grant_permission(user, Permission::read_write(keys.root()).with_prefix())
        .await
        .map_err(unavailable("grant the cluster prefix"))?;

    let users = client
        .user_list()
        .await
        .map_err(unavailable("list etcd users"))?;
    let exists = |name: &str| users.users().iter().any(|u| u == name);
    if !exists("root") {
        client
            .user_add("root", "", Some(UserAddOptions::new().with_no_pwd()))
            .await
            .map_err(unavailable("add the root user"))?;
        setup.created.push("user:root".into());
    }
    // Granting a role a user already has is a no-op in etcd.
    client
        .user_grant_role("root", "root")
        .await
        .map_err(unavailable("grant root its role"))?;
    if exists(user) {
        client
            .user_change_password(user, password)
            .await
            .map_err(unavailable("set the member user's password"))?;
    } else {
        client
            .user_add(user, password, None)
            .await
            .map_err(unavailable("add the member user"))?;
        setup.created.push(format!("user:{user}"));
    }
    client
        .user_grant_role(user, user)
        .await
        .map_err(unavailable("grant the member user its role"))?;

    // Already on: etcd ignores the request.
    client
        .auth_enable()
        .await
        .map_err(unavailable("enable etcd's authentication"))?;
    Ok(setup)
}
