//! The code generated from the vendored protocol files (`proto/`), one module per package.
#![allow(missing_docs, unreachable_pub, clippy::all, clippy::pedantic)]

/// `envoy.*`
pub mod envoy {
    /// `envoy.config.*`
    pub mod config {
        /// `envoy.config.core.*`
        pub mod core {
            /// `envoy.config.core.v3`
            pub mod v3 {
                tonic::include_proto!("envoy.config.core.v3");
            }
        }
    }
    /// `envoy.extensions.*`
    pub mod extensions {
        /// `envoy.extensions.filters.*`
        pub mod filters {
            /// `envoy.extensions.filters.http.*`
            pub mod http {
                /// `envoy.extensions.filters.http.ext_proc.*`
                pub mod ext_proc {
                    /// `envoy.extensions.filters.http.ext_proc.v3`
                    pub mod v3 {
                        tonic::include_proto!("envoy.extensions.filters.http.ext_proc.v3");
                    }
                }
            }
        }
    }
    /// `envoy.type.*`
    pub mod r#type {
        /// `envoy.type.v3`
        pub mod v3 {
            tonic::include_proto!("envoy.r#type.v3");
        }
    }
    /// `envoy.service.*`
    pub mod service {
        /// `envoy.service.ext_proc.*`
        pub mod ext_proc {
            /// `envoy.service.ext_proc.v3`
            pub mod v3 {
                tonic::include_proto!("envoy.service.ext_proc.v3");
            }
        }
    }
}

/// `udpa.*`
pub mod udpa {
    /// `udpa.annotations`
    pub mod annotations {
        tonic::include_proto!("udpa.annotations");
    }
}

/// `xds.*`
pub mod xds {
    /// `xds.annotations.*`
    pub mod annotations {
        /// `xds.annotations.v3`
        pub mod v3 {
            tonic::include_proto!("xds.annotations.v3");
        }
    }
    /// `xds.core.*`
    pub mod core {
        /// `xds.core.v3`
        pub mod v3 {
            tonic::include_proto!("xds.core.v3");
        }
    }
}

/// `validate`
pub mod validate {
    tonic::include_proto!("validate");
}
