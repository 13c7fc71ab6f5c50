# bash completion for the kvdepot CLI. Commands, subcommands and options are
# read from the kvdepot binary's own help (`kvdepot --help`, `kvdepot help
# CMD`), so they follow whichever version is installed.
#
# Installed as share/bash-completion/completions/kvdepot; by hand:
#   source client/cli/kvdepot.bash

_kvdepot_globals="--addr --deadline-ms --tls --tls-ca --ca --tls-cert --tls-key
--tls-server-name --token --json --progress --no-progress --help --version"

_kvdepot() {
    local cur=${COMP_WORDS[COMP_CWORD]} prev=
    [ "$COMP_CWORD" -gt 0 ] && prev=${COMP_WORDS[COMP_CWORD - 1]}
    local prog=${COMP_WORDS[0]}
    COMPREPLY=()

    # Values of options.
    case $prev in
    --file | --q | --out | --token-ids | --tls-ca | --ca | --tls-cert | --tls-key)
        mapfile -t COMPREPLY < <(compgen -f -- "$cur")
        return
        ;;
    --dtype)
        mapfile -t COMPREPLY < <(compgen -W "f16 bf16 f32" -- "$cur")
        return
        ;;
    --k | --v)
        mapfile -t COMPREPLY < <(compgen -W "raw int2 int4 vq-d4b8 vq-d8b12" -- "$cur")
        return
        ;;
    --addr | --deadline-ms | --tls-server-name | --token | --model | --tokens | --layers | \
        --layer-start | --token-start | --layer | --bandwidth | --flops | --ttl | --pq | --kind)
        return
        ;;
    esac

    # The command: the first word that is neither an option nor a global
    # option's value.
    local i=1 cmd='' w
    while [ "$i" -lt "$COMP_CWORD" ]; do
        w=${COMP_WORDS[i]}
        case $w in
        --addr | --deadline-ms | --tls-ca | --ca | --tls-cert | --tls-key | --tls-server-name | --token)
            i=$((i + 2))
            ;;
        -*) i=$((i + 1)) ;;
        *)
            cmd=$w
            break
            ;;
        esac
    done

    if [ -z "$cmd" ]; then
        if [[ $cur == -* ]]; then
            mapfile -t COMPREPLY < <(compgen -W "$_kvdepot_globals" -- "$cur")
        else
            local cmds
            cmds=$("$prog" --help 2>/dev/null | sed -n 's/^  \([a-z][a-z-]*\).*/\1/p' | sort -u)
            mapfile -t COMPREPLY < <(compgen -W "$cmds help version" -- "$cur")
        fi
        return
    fi

    if [ "$cmd" = help ]; then
        local cmds
        cmds=$("$prog" --help 2>/dev/null | sed -n 's/^  \([a-z][a-z-]*\).*/\1/p' | sort -u)
        mapfile -t COMPREPLY < <(compgen -W "$cmds" -- "$cur")
        return
    fi

    local usage
    usage=$("$prog" help "$cmd" 2>/dev/null) || return
    # A subcommand right after the command: "model put ...", "seq stat ...",
    # "artifacts get|put ...".
    if [ "$i" -eq $((COMP_CWORD - 1)) ] && [[ $cur != -* ]]; then
        local subs
        subs=$(printf '%s\n' "$usage" | sed -n "s/^  $cmd \([a-z][a-z|-]*\).*/\1/p" | tr '|' '\n')
        if [ -n "$subs" ]; then
            mapfile -t COMPREPLY < <(compgen -W "$subs" -- "$cur")
            return
        fi
    fi
    if [[ $cur == -* ]]; then
        local opts
        opts=$(printf '%s\n' "$usage" | grep -o -- '--[a-z][a-z-]*' | sort -u)
        mapfile -t COMPREPLY < <(compgen -W "$opts $_kvdepot_globals" -- "$cur")
    fi
}

complete -o default -F _kvdepot kvdepot
