{{/* The KV event plane (values `eventPlane`): the flags, environment, mounts and volumes the
gateways and the workers share, and the NATS they use (the chart's own JetStream StatefulSet,
templates/event-plane-nats.yaml, or an existing one at `eventPlane.url`). */}}

{{- define "switchyard.natsName" -}}
{{- printf "%s-nats" (include "switchyard.fullname" .) -}}
{{- end -}}

{{- define "switchyard.natsSecretName" -}}
{{- default (include "switchyard.natsName" .) .Values.eventPlane.auth.existingSecret -}}
{{- end -}}

{{/* The NATS URL of the plane. */}}
{{- define "switchyard.natsUrl" -}}
{{- $e := .Values.eventPlane -}}
{{- if $e.url -}}
{{- $e.url -}}
{{- else -}}
{{- printf "%s://%s:4222" (ternary "tls" "nats" $e.tls.enabled) (include "switchyard.natsName" .) -}}
{{- end -}}
{{- end -}}

{{- define "switchyard.eventPlaneArgs" -}}
{{- $e := .Values.eventPlane -}}
{{- if $e.enabled }}
{{- if and $e.tls.enabled (not $e.tls.existingSecret) }}
{{- fail "eventPlane.tls.enabled needs eventPlane.tls.existingSecret (ca.crt; tls.crt and tls.key for the chart's NATS)" }}
{{- end }}
- --event-plane={{ include "switchyard.natsUrl" . }}
- --event-plane-max-age-secs={{ int64 $e.maxAgeSecs }}
- --event-plane-max-bytes={{ int64 $e.maxBytes }}
- --event-plane-storage={{ $e.storage }}
- --event-plane-digest-interval-ms={{ int64 $e.digestIntervalMs }}
{{- if $e.tls.enabled }}
- --event-plane-ca=/var/run/switchyard/nats-tls/ca.crt
{{- end }}
{{- end }}
{{- end -}}

{{/* The NATS user and password, from the Secret, as environment variables. */}}
{{- define "switchyard.eventPlaneEnv" -}}
{{- $e := .Values.eventPlane -}}
{{- if and $e.enabled $e.auth.enabled }}
- name: SWITCHYARD_EVENT_PLANE_USER
  valueFrom:
    secretKeyRef:
      name: {{ include "switchyard.natsSecretName" . }}
      key: {{ $e.auth.userKey }}
- name: SWITCHYARD_EVENT_PLANE_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "switchyard.natsSecretName" . }}
      key: {{ $e.auth.passwordKey }}
{{- end }}
{{- end -}}

{{- define "switchyard.eventPlaneMounts" -}}
{{- $e := .Values.eventPlane -}}
{{- if and $e.enabled $e.tls.enabled }}
- name: nats-tls
  mountPath: /var/run/switchyard/nats-tls
  readOnly: true
{{- end }}
{{- end -}}

{{- define "switchyard.eventPlaneVolumes" -}}
{{- $e := .Values.eventPlane -}}
{{- if and $e.enabled $e.tls.enabled }}
- name: nats-tls
  secret:
    secretName: {{ $e.tls.existingSecret }}
    items:
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- end -}}
