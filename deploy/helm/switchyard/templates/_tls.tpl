{{/*
Certificates (docs/security.md, "Kubernetes"): each member of the release (gateway, worker,
planner) mounts one Secret (tls.crt, tls.key, ca.crt) at /var/run/switchyard/tls: its mTLS
identity (the URI spiffe://switchyard/<cluster>/<role>) and the certificate of its HTTP listener.
The Secrets are cert-manager's (templates/certificates.yaml) or given (tls.existingSecrets).
Kubernetes updates a mounted Secret in place when cert-manager renews it; the binaries re-read
the files within a second, so a rotation needs no restart.
*/}}

{{/* A component's certificate Secret; call with (dict "ctx" $ "component" "gateway"). */}}
{{- define "switchyard.tlsSecretName" -}}
{{- $given := index .ctx.Values.tls.existingSecrets .component -}}
{{- default (printf "%s-%s-tls" (include "switchyard.fullname" .ctx) (kebabcase .component)) $given -}}
{{- end -}}

{{/* The cluster's identity URI of a role; call with (dict "ctx" $ "role" "worker"). */}}
{{- define "switchyard.identityUri" -}}
{{- printf "spiffe://switchyard/%s/%s" .ctx.Values.cluster .role -}}
{{- end -}}

{{/* mTLS flags of a member (gateway, worker, planner). */}}
{{- define "switchyard.memberTlsArgs" -}}
{{- if .Values.tls.enabled }}
- --tls-cert=/var/run/switchyard/tls/tls.crt
- --tls-key=/var/run/switchyard/tls/tls.key
- --tls-ca=/var/run/switchyard/tls/ca.crt
{{- end }}
{{- end -}}

{{- define "switchyard.memberTlsMount" -}}
{{- if .Values.tls.enabled }}
- name: member-tls
  mountPath: /var/run/switchyard/tls
  readOnly: true
{{- end }}
{{- end -}}

{{/* Call with (dict "ctx" $ "component" "worker"). */}}
{{- define "switchyard.memberTlsVolume" -}}
{{- if .ctx.Values.tls.enabled }}
- name: member-tls
  secret:
    secretName: {{ include "switchyard.tlsSecretName" . }}
    items:
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- end -}}

{{/* HTTPS on the workers' metrics port and the planner's listener (probes included). */}}
{{- define "switchyard.sideHttps" -}}
{{- if and .Values.tls.enabled .Values.tls.sideListeners -}}true{{- end -}}
{{- end -}}

{{/* HTTPS on the gateway's port. */}}
{{/* "true" when the gateway replicas share sessions (gateway.shareSessions): they find each other
in etcd and forward over plain HTTP, authenticated by the cluster secret when tls is on. */}}
{{- define "switchyard.gatewayShareSessions" -}}
{{- $mode := .Values.gateway.shareSessions -}}
{{- $why := "" -}}
{{- if not (has .Values.discovery (list "etcd" "both")) -}}
{{- $why = "etcd discovery (discovery: etcd or both), where the replicas find each other" -}}
{{- else if include "switchyard.gatewayHttps" . -}}
{{- $why = "a plain-HTTP gateway port (tls.gatewayHttps: false), as the forwarding hop does not speak HTTPS yet" -}}
{{- else if and .Values.tls.enabled (not .Values.security.clusterSecret.enabled) -}}
{{- $why = "the cluster secret (security.clusterSecret.enabled), which authenticates the forwarding hop" -}}
{{- end -}}
{{- if and (eq $mode "always") $why -}}
{{- fail (printf "gateway.shareSessions=always needs %s; set it to auto or never" $why) -}}
{{- end -}}
{{- if and (ne $mode "never") (not $why) -}}true{{- end -}}
{{- end -}}

{{- define "switchyard.gatewayHttps" -}}
{{- if and .Values.tls.enabled .Values.tls.gatewayHttps -}}true{{- end -}}
{{- end -}}

{{/* etcd over TLS with a client certificate: the chart's etcd (etcd.tls), or an external one
whose client files are given (etcd.externalTls.existingSecret). */}}
{{- define "switchyard.etcdTls" -}}
{{- if or (and .Values.etcd.enabled .Values.etcd.tls.enabled) (and (not .Values.etcd.enabled) .Values.etcd.externalTls.existingSecret) -}}true{{- end -}}
{{- end -}}

{{- define "switchyard.etcdClientSecretName" -}}
{{- if .Values.etcd.enabled -}}
{{- include "switchyard.tlsSecretName" (dict "ctx" . "component" "etcdClient") -}}
{{- else -}}
{{- .Values.etcd.externalTls.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "switchyard.etcdTlsArgs" -}}
{{- if include "switchyard.etcdTls" . }}
- --etcd-ca=/var/run/switchyard/etcd/ca.crt
- --etcd-cert=/var/run/switchyard/etcd/tls.crt
- --etcd-key=/var/run/switchyard/etcd/tls.key
{{- end }}
{{- if and .Values.etcd.enabled .Values.etcd.auth.enabled }}
- --etcd-username=switchyard
- --etcd-password-file=/var/run/switchyard/etcd-password/password
{{- end }}
{{- end -}}

{{- define "switchyard.etcdTlsMount" -}}
{{- if include "switchyard.etcdTls" . }}
- name: etcd-client-tls
  mountPath: /var/run/switchyard/etcd
  readOnly: true
{{- end }}
{{- if and .Values.etcd.enabled .Values.etcd.auth.enabled }}
- name: etcd-password
  mountPath: /var/run/switchyard/etcd-password
  readOnly: true
{{- end }}
{{- end -}}

{{- define "switchyard.etcdTlsVolume" -}}
{{- if include "switchyard.etcdTls" . }}
- name: etcd-client-tls
  secret:
    secretName: {{ include "switchyard.etcdClientSecretName" . }}
    items:
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- if and .Values.etcd.enabled .Values.etcd.auth.enabled }}
- name: etcd-password
  secret:
    secretName: {{ include "switchyard.fullname" . }}-etcd-auth
    items:
      - key: password
        path: password
{{- end }}
{{- end -}}

{{/* Everything a member container mounts for TLS; call with (dict "ctx" $ "component" "worker"). */}}
{{- define "switchyard.tlsMounts" -}}
{{- include "switchyard.memberTlsMount" .ctx }}
{{- include "switchyard.etcdTlsMount" .ctx }}
{{- end -}}

{{- define "switchyard.tlsVolumes" -}}
{{- include "switchyard.memberTlsVolume" . }}
{{- include "switchyard.etcdTlsVolume" .ctx }}
{{- end -}}

{{/* mTLS and etcd flags of a member. */}}
{{- define "switchyard.tlsArgs" -}}
{{- include "switchyard.memberTlsArgs" . }}
{{- include "switchyard.etcdTlsArgs" . }}
{{- end -}}
