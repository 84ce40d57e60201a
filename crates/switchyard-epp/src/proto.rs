//! Envoy's external processing protocol: the code tonic/prost generate from the protos vendored
//! under `proto/envoy` (trimmed, wire-identical; see `proto/envoy/README.md`). The module tree
//! follows the proto packages, as the generated code refers across them by relative path.

#![allow(
    clippy::all,
    clippy::pedantic,
    missing_debug_implementations,
    unreachable_pub
)]

pub mod envoy {
    pub mod config {
        pub mod core {
            pub mod v3 {
                tonic::include_proto!("envoy.config.core.v3");
            }
        }
    }
    pub mod r#type {
        pub mod v3 {
            tonic::include_proto!("envoy.r#type.v3");
        }
    }
    pub mod extensions {
        pub mod filters {
            pub mod http {
                pub mod ext_proc {
                    pub mod v3 {
                        tonic::include_proto!("envoy.extensions.filters.http.ext_proc.v3");
                    }
                }
            }
        }
    }
    pub mod service {
        pub mod ext_proc {
            pub mod v3 {
                tonic::include_proto!("envoy.service.ext_proc.v3");
            }
        }
    }
}

pub use envoy::config::core::v3 as core;
pub use envoy::extensions::filters::http::ext_proc::v3 as mode;
pub use envoy::service::ext_proc::v3 as ext_proc;
pub use envoy::r#type::v3 as http_status;
