{{/* Fleet-wide quotas (values `quota`): the gateway's flags, mounts and volumes, and the
Redis the replicas count in (the chart's own, templates/quota-redis.yaml, or an external one). */}}

{{- define "switchyard.quotaRedisName" -}}
{{- printf "%s-quota-redis" (include "switchyard.fullname" .) -}}
{{- end -}}

{{- define "switchyard.quotaRedisSecretName" -}}
{{- default (include "switchyard.quotaRedisName" .) .Values.quota.redis.auth.existingSecret -}}
{{- end -}}

{{/* The Redis URL the gateways use. */}}
{{- define "switchyard.quotaRedisUrl" -}}
{{- $r := .Values.quota.redis -}}
{{- if $r.enabled -}}
{{- printf "%s://%s:6379" (ternary "rediss" "redis" $r.tls.enabled) (include "switchyard.quotaRedisName" .) -}}
{{- else -}}
{{- required "quota.redis.url is needed when quota.redis.enabled is false" $r.url -}}
{{- end -}}
{{- end -}}

{{- define "switchyard.quotaArgs" -}}
{{- $q := .Values.quota -}}
{{- if $q.enabled }}
{{- if and $q.redis.tls.enabled (not $q.redis.tls.existingSecret) }}
{{- fail "quota.redis.tls.enabled needs quota.redis.tls.existingSecret (tls.crt, tls.key, ca.crt)" }}
{{- end }}
- --quota-redis-url={{ include "switchyard.quotaRedisUrl" . }}
- --quota-window-secs={{ int64 $q.windowSecs }}
- --quota-requests-per-window={{ int64 $q.requestsPerWindow }}
- --quota-tokens-per-window={{ int64 $q.tokensPerWindow }}
- --quota-concurrent-requests={{ int64 $q.concurrentRequests }}
- --quota-on-store-error={{ $q.onStoreError }}
- --quota-store-timeout-ms={{ int64 $q.storeTimeoutMs }}
{{- if $q.redis.auth.enabled }}
- --quota-redis-password-file=/var/run/switchyard/quota-redis/{{ $q.redis.auth.secretKey }}
{{- with $q.redis.auth.username }}
- --quota-redis-username={{ . }}
{{- end }}
{{- end }}
{{- if $q.redis.tls.enabled }}
- --quota-redis-ca-file=/var/run/switchyard/quota-redis-tls/ca.crt
{{- end }}
{{- end }}
{{- end -}}

{{- define "switchyard.quotaMounts" -}}
{{- $q := .Values.quota -}}
{{- if $q.enabled }}
{{- if $q.redis.auth.enabled }}
- name: quota-redis-auth
  mountPath: /var/run/switchyard/quota-redis
  readOnly: true
{{- end }}
{{- if $q.redis.tls.enabled }}
- name: quota-redis-tls
  mountPath: /var/run/switchyard/quota-redis-tls
  readOnly: true
{{- end }}
{{- end }}
{{- end -}}

{{- define "switchyard.quotaVolumes" -}}
{{- $q := .Values.quota -}}
{{- if $q.enabled }}
{{- if $q.redis.auth.enabled }}
- name: quota-redis-auth
  secret:
    secretName: {{ include "switchyard.quotaRedisSecretName" . }}
    items:
      - key: {{ $q.redis.auth.secretKey }}
        path: {{ $q.redis.auth.secretKey }}
{{- end }}
{{- if $q.redis.tls.enabled }}
- name: quota-redis-tls
  secret:
    secretName: {{ $q.redis.tls.existingSecret }}
    items:
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- end }}
{{- end -}}
